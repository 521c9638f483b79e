"""The worker's heartbeat thread: proof of life while the step loop computes.

The step loop answers `Ping` only between engine steps, and one prefill chunk
of a 300 MiB float16 model took 4.7-12.2 s on a small CPU: longer than the
heartbeat window, so a healthy worker busy with a long prompt was killed as
wedged. MLX releases the GIL while it evaluates, so this thread
keeps running and pushes `Alive` with what the loop is doing (in a step for
how long, steps and tokens so far) on its own PUSH socket (ZeroMQ sockets are
not thread-safe; this one is created and used only here).

It proves only what it says: a SIGSTOPped process stops this thread too, and
a loop stuck outside a step is reported as such, so the supervisor still
catches both within today's window. The supervisor decides; this thread only
reports.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Literal

import zmq

from shared import protocol as p
from shared.vocab import LoadPhase

LOAD_REPORT_INTERVAL = 0.25  # seconds between reports while the model loads (W6)
_PROC_IO = Path("/proc/self/io")


def bytes_read_so_far() -> int:
    """Bytes this process has read through read() and its kind (0 where the OS does not count them)."""
    try:
        with _PROC_IO.open("rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class StepClock:
    """Written by the step loop, read by the heartbeat thread (floats and ints
    are replaced whole under the GIL, so a reader sees one value or the other)."""

    def __init__(self) -> None:
        self.step_started = 0.0   # monotonic start of the current step; 0 between steps
        self.boundary = time.monotonic()
        self.steps = 0
        self.tokens = 0
        # W6: the phase of the model's load in progress ("" when none), and the process's
        # bytes read when it began (the weights read are counted against it)
        self.load_phase: LoadPhase | Literal[""] = ""
        self.read_base = 0

    def start_load(self) -> None:
        """A load begins (worker.loader): the bytes read from now on are its weights."""
        self.read_base = bytes_read_so_far()

    def enter_step(self) -> None:
        self.step_started = time.monotonic()

    def leave_step(self, tokens: int) -> None:
        now = time.monotonic()
        self.step_started = 0.0
        self.boundary = now
        self.steps += 1
        self.tokens = tokens

    def alive(self, worker_id: str, now: float) -> p.Alive:
        started, phase = self.step_started, self.load_phase
        read = max(0, bytes_read_so_far() - self.read_base) if phase and phase != "hello" else 0  # the weights
        return p.Alive(worker_id=worker_id, pid=os.getpid(), step_seconds=now - started if started else 0.0,
                       loop_seconds=now - self.boundary, steps=self.steps, tokens=self.tokens, load_phase=phase,
                       bytes_read=read)


class Heartbeat(threading.Thread):
    """Pushes the clock's `Alive` every `interval` seconds until `stop()`."""

    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: str, clock: StepClock, interval: float) -> None:
        super().__init__(name="memvisor-heartbeat", daemon=True)
        self.ctx = ctx
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.clock = clock
        self.interval = interval
        self._halt = threading.Event()  # not `_stop`: threading.Thread has a method of that name

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a stale proof of life is worth nothing: never queue many
        sock.connect(self.endpoint)
        codec = p.Codec(p.WorkerReport)
        try:
            while True:  # the first report at once: a new worker is judged from its first word
                try:
                    sock.send(codec.encode(self.clock.alive(self.worker_id, time.monotonic())), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                # W6: a load's progress is worth a report four times a second
                if self._halt.wait(min(self.interval, LOAD_REPORT_INTERVAL) if self.clock.load_phase else self.interval):
                    break
        finally:
            sock.close(0)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2.0)
