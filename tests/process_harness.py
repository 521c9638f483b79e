"""Stopping a server process the tests or the scripts started, as a user would: SIGTERM, then a kill."""

from __future__ import annotations

import signal
import subprocess


def sigterm_then_kill(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM `proc` and wait up to `grace` seconds for it; SIGKILL it if it is still there.

    Why both: the supervisor drains its workers on SIGTERM (what is under test), and a
    process that does not exit in time must still never outlive the test or the script."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
