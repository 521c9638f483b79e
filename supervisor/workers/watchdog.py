"""The heartbeat: every worker pinged, its silence judged, the wedged killed.

At each heartbeat the arbiter asks for a round: each serving worker (and each
waiting spare, W1) gets a `Ping` on its command socket, and one silent past
its window is wedged: counted, said, and killed, since a wedged worker will
not obey a drain. What silence means (while loading, inside one long engine
step) is supervisor.workers.liveness's judgement, pure; this is its shell, apart from
the pool so that the pool keeps processes (spawn, command, stop, reap) and
nothing else. After a stall of the supervisor's own loop nobody's silence
counts (`forgive`). `ping` is one round trip awaited (chaos, benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from shared import protocol as p
from shared.states import LOADING_STATES
from shared.vocab import StopCause
from supervisor.workers import liveness
from supervisor.workers.process import EventSink, Wedged, WorkerHandle

if TYPE_CHECKING:
    from supervisor.config import Config
    from supervisor.guard.counters import SupervisorCounters

log = logging.getLogger("memvisor.pool")


class Pool(Protocol):
    """What the watchdog needs of the pool (supervisor.workers.pool.Pool)."""

    handles: dict[str, WorkerHandle]
    config: Config
    counters: SupervisorCounters
    on_event: EventSink

    def command(self, handle: WorkerHandle, msg: p.Command) -> bool: ...

    def kill(self, handle: WorkerHandle, reason: str, cause: StopCause = "request") -> asyncio.Task: ...


class Watchdog:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        # (worker id, ping seq) -> who awaits that pong (`ping`'s round trip)
        self._pings: dict[tuple[str, int], asyncio.Future] = {}

    def heartbeat(self, now: float) -> None:
        """Ping every serving worker; kill those silent past their window (wedged).

        A draining worker is left to its stop's own escalation (supervisor.workers.liveness
        says what silence means while loading and inside a long engine step)."""
        scfg = self.pool.config.supervisor
        for h in list(self.pool.handles.values()):
            loading = h.state in LOADING_STATES
            answers = h.serving or h.state == "spare"  # W1: a waiting spare is judged as a serving worker
            if (loading and h.stopping is None) or answers:
                why = liveness.wedged(h.beats, loading, now, scfg)
                if why is not None:
                    self._wedged(h, why)
                elif answers:
                    self.pool.command(h, p.Ping(seq=h.next_ping()))

    def _wedged(self, handle: WorkerHandle, why: str) -> None:
        self.pool.counters.wedged += 1
        log.error("Worker %s (pid %d): %s: wedged; killing it", handle.worker_id, handle.pid, why)
        handle.move("silent")
        self.pool.on_event(Wedged(handle, why))
        self.pool.kill(handle, "wedged", cause="wedged")

    def forgive(self, now: float, stalled: float) -> None:
        """The supervisor's own loop could not run for `stalled` seconds: every worker
        gets a fresh heartbeat window (supervisor.workers.liveness.forgiven)."""
        for h in self.pool.handles.values():
            h.forgive(now, stalled)

    def ponged(self, handle: WorkerHandle, seq: int, now: float) -> None:
        """Its step loop answered ping `seq`: whoever awaits that round trip hears when."""
        handle.ponged(now)
        waiter = self._pings.pop((handle.worker_id, seq), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(now)

    async def ping(self, handle: WorkerHandle, timeout: float = 5.0) -> float:
        """Round trip of one command to the worker's step loop and back, in seconds."""
        key = (handle.worker_id, handle.next_ping())
        waiter = asyncio.get_running_loop().create_future()
        self._pings[key] = waiter
        sent = time.monotonic()
        self.pool.command(handle, p.Ping(seq=key[1]))
        try:
            return await asyncio.wait_for(waiter, timeout) - sent
        finally:
            self._pings.pop(key, None)

    def step_seconds(self, handle: WorkerHandle, now: float) -> float:
        """How long the worker's current engine step has run (0 between steps)."""
        return liveness.step_seconds(handle.beats, now, self.pool.config.supervisor)

    def unresponsive(self, handle: WorkerHandle, now: float) -> float | None:
        """Seconds a serving worker has not answered a ping, past half its window; else None."""
        if not handle.serving:
            return None
        return liveness.unresponsive(handle.beats, now, self.pool.config.supervisor)
