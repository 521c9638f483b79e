"""Out of descriptors, the supervisor still reaps exited workers and
stops on SIGTERM. A real `serve` process under a lowered RLIMIT_NOFILE, its
front door flooded with connections that never send a request."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from shared import protocol as p

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NOFILE = 160


def _limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # mlx_lm raises its own soft limit to 2048
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard))


def _reaped(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def _ready(runtime_dir: Path) -> tuple[int, str]:
    from supervisor.wiring.client import ControlClient

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with ControlClient(runtime_dir, timeout=2) as client:
                reply = client.call(p.StatusRequest())
            if isinstance(reply, p.ControlOk):
                status = msgspec.json.decode(reply.data)
                ready = [w for w in status["guard"]["workers"] if w["state"] in ("ready", "busy")]
                if ready and status["http"]:
                    return ready[0]["pid"], status["http"]
        except Exception:
            pass
        time.sleep(0.3)
    raise AssertionError("the supervisor did not come up")


def test_out_of_descriptors_a_dead_worker_is_still_reaped_and_sigterm_still_stops_it(
        tiny_models, tmp_path_factory):
    """Before: Process.join's lazy import failed with EMFILE inside the exit callback, so the
    killed worker stayed a zombie for good, and asyncio logged a traceback per refused
    connection (5.6 MB of log in 10 s) while the loop did little else."""
    runtime_dir = Path(tmp_path_factory.mktemp("fds"))
    cfg = runtime_dir / "c.toml"
    cfg.write_text("[supervisor]\nheartbeat_interval = 0.2\nheartbeat_timeout = 2.0\nstop_grace = 2.0\n"
                   f'[[models]]\nid = "a"\npath = "{tiny_models.a}"\npinned = true\n')
    log_path = Path(os.environ.get("MEMVISOR_TEST_LOG", runtime_dir / "serve.log"))
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config", str(cfg), "--runtime-dir",
                             str(runtime_dir), "--http", "127.0.0.1:0"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=_limit)
    conns: list[socket.socket] = []
    try:
        pid, http = _ready(runtime_dir)
        host, port = http.rsplit(":", 1)
        for _ in range(NOFILE + 40):  # more than it can hold: its accept() fails with EMFILE
            try:
                conns.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _reaped(pid):
            time.sleep(0.1)
        assert _reaped(pid), "the killed worker was never reaped (a zombie)"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # twice: stop without draining
            proc.wait(10)
        assert proc.returncode is not None
    finally:
        for conn in conns:
            conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    text = log_path.read_bytes()
    assert len(text) < 200_000, f"the log grew to {len(text)} bytes"  # before: 5.6 MB in 10 s
    # Since the front door raises its soft open-file limit and caps connections below it
    # (supervisor/http/connection_limits.py), this flood no longer drives accept() to EMFILE; whether it
    # did ("cannot accept connections") or the cap held it, the reap and the stop above must work.
