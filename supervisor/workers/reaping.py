"""A worker process's exit, learned without blocking the supervisor's loop.

Why apart from the pool: it is process mechanics, not worker state. The
process's sentinel becomes readable as the child closes its pipe, a moment
before the kernel has its exit status, so the status is polled briefly on
the loop's timer instead of waited for; and when descriptors have run out,
even that poll can fail, so it is tried again until it works: an exit is
never lost.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import multiprocess.connection  # noqa: F401  (Process.join imports it lazily, which fails once descriptors run out)
import multiprocess.process

log = logging.getLogger("memvisor.pool")

POLLS = 200          # the exit status is polled this many times, 5 ms apart, after the sentinel
POLL_SECONDS = 0.005
RETRY_SECONDS = 0.05  # after a failed poll (out of descriptors)


def on_exit(proc: multiprocess.process.BaseProcess, exited: Callable[[int | None], None], name: str) -> None:
    """Call `exited(exit code)` once `proc` has exited (None: the status never came)."""
    loop = asyncio.get_running_loop()

    def reap(tries: int) -> None:
        try:
            proc.join(0)
        except OSError as exc:  # out of descriptors: keep trying, never lose the exit
            if tries % POLLS == 0:
                log.warning("Reaping worker %s (pid %s) failed: %s; trying again", name, proc.pid, exc)
            loop.call_later(RETRY_SECONDS, reap, tries + 1)
            return
        if proc.exitcode is None and tries < POLLS:
            loop.call_later(POLL_SECONDS, reap, tries + 1)
            return
        exited(proc.exitcode)

    def sentinel() -> None:
        loop.remove_reader(proc.sentinel)
        reap(0)

    loop.add_reader(proc.sentinel, sentinel)
