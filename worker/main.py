"""The spawn target: a worker process's setup, then its life (worker/loop.py).

Setup is what must hold before any model code runs: the process dies with its
supervisor, logs say which worker speaks, ^C belongs to the supervisor and
SIGTERM exits cleanly, and OpenBLAS is loaded before MLX binds its BLAS.

MLX is never imported at module level here or in what this imports: the
supervisor imports this module to name the spawn target and must not load MLX.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

import msgspec

from shared import protocol as p
from worker import blas
from worker.loop import LOAD_DELAY_ENV, STEP_DELAY_ENV, Worker

__all__ = ["LOAD_DELAY_ENV", "STEP_DELAY_ENV", "run"]  # the delays: tests set them before a spawn

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills us when the supervisor dies, even by SIGKILL.
    Elsewhere the loop notices the parent is gone (getppid changes)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)


def run(spec_bytes: bytes) -> None:
    """Spawn target. Exit codes: 0 drained/told to stop, 2 load failed, 3 bad spec."""
    started = time.monotonic()  # W3: the process's start ends here, its imports begin
    try:
        spec = msgspec.msgpack.decode(spec_bytes, type=p.WorkerSpec)
    except msgspec.DecodeError as exc:
        print(f"memvisor worker: unusable start spec: {exc}", file=sys.stderr)
        os._exit(3)
    _die_with_parent(spec.supervisor_pid)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s worker {spec.worker_id}[{os.getpid()}]: %(message)s",
    )
    blas.preload()  # OpenBLAS before the first `import mlx.core`, so libmlx binds to it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in the terminal is the supervisor's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    worker = Worker(spec, started)
    try:
        code = worker.serve()
    finally:
        worker.close()
    sys.exit(code)
