"""Spare workers carried out (SPEC W1, W2): started, handed a model, their figures kept.

The policy (supervisor.policy.spares) decides when a spare starts and when
spares are stopped; the enforcer asks the pool, and this part of the pool
does it. It also keeps what the policy reads about spares and cannot measure
itself: what a spare holds (the latest reading of a waiting one), when the next
may start after spares died (the restart intensity of supervisor.workers.intensity,
so a spare that crashes at start does not loop), and whether a model load is
waiting (no spare starts meanwhile: a spare never delays a load).

A load takes a ready spare: one in state `spare` that answered a ping
recently (a SIGSTOPped spare is not handed a model). With none ready but one
still starting, the load waits for that one's hello, a bounded time: it is
closer to ready than a fresh process would be.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from shared import protocol as p
from shared.vocab import StopCause
from supervisor.doors.refusals import LoadError
from supervisor.workers import intensity, load_clock
from supervisor.workers.process import EventSink, SpareNews, WorkerHandle, worker_spec

if TYPE_CHECKING:
    from shared.ledger import Ledger
    from supervisor.config import Config, ModelConfig, SupervisorConfig
    from supervisor.wiring.bus import Bus
    from supervisor.workers.load_timer import LoadTimer


class Pool(Protocol):
    """What this part of the pool uses of the rest of it (supervisor.workers.pool.Pool)."""

    handles: dict[str, WorkerHandle]
    config: Config
    ledger: Ledger
    bus: Bus
    on_event: EventSink
    timer: LoadTimer

    def spawn(self, model: ModelConfig | None, *, began: float = 0.0, estimate: int = 0) -> WorkerHandle: ...

    def command(self, handle: WorkerHandle, msg: p.Command) -> bool: ...

    def stop(self, handle: WorkerHandle, reason: str, *, kill_now: bool = False,
             cause: StopCause = "request") -> asyncio.Task: ...

log = logging.getLogger("memvisor.pool")

# Seconds a load waits for a spare still starting, at most, when no start time has
# been measured yet (then twice the last measured start).
STARTING_WAIT_DEFAULT = 10.0


class Spares:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.held = 0           # bytes the latest waiting spare held (U1): what the next one is expected to
        self.start_seconds = 0.0  # the last spare's spawn -> hello
        self.deaths: list[float] = []  # when spares exited unasked (the restart intensity counts them)
        self.loads_waiting = 0  # model loads begun and not over

    def live(self) -> list[WorkerHandle]:
        """The spares not on their way out: starting, or waiting for a model."""
        return [h for h in self.pool.handles.values() if h.spare and h.live and h.stopping is None]

    def ready(self, now: float) -> WorkerHandle | None:
        """A waiting spare that answered its last ping in time (the oldest first)."""
        window = 2 * self.pool.config.supervisor.heartbeat_interval + 0.5
        for h in self.live():
            if h.state == "spare" and now - h.beats.last_pong <= window:
                return h
        return None

    # -- what the enforcer asks -------------------------------------------------------

    def start(self, reason: str) -> WorkerHandle | None:
        """A spare, started now; None when the OS or the ledger has no room for one (it counts
        as a death, so the next try waits a backoff instead of failing at every tick)."""
        log.info("Starting a spare worker: %s", reason)
        try:
            return self.pool.spawn(None)
        except LoadError as exc:
            log.warning("Could not start a spare worker: %s", exc)
            self.deaths.append(time.monotonic())
            return None

    def stop(self, handle: WorkerHandle, reason: str) -> asyncio.Task:
        self.pool.on_event(SpareNews(handle, f"spare pid {handle.pid} stopped: {reason}"))
        return self.pool.stop(handle, f"spare: {reason}", cause="spare")

    # -- what a load asks (supervisor.models.life) ---------------------------------------------

    async def take(self, model: ModelConfig, *, began: float, estimate: int) -> WorkerHandle | None:
        """W1: a ready spare handed `model` (waiting for one still starting), or None: spawn afresh."""
        spare = self.ready(time.monotonic()) or await self._starting_one()
        if spare is None:
            return None
        if not self._hand_off(spare, model, began=began, estimate=estimate):
            self.stop(spare, "the hand-off could not be sent")
            return None
        return spare

    async def _starting_one(self) -> WorkerHandle | None:
        starting = [h for h in self.live() if h.state == "starting"]
        if not starting:
            return None
        h = starting[0]
        wait = 2 * self.start_seconds if self.start_seconds else STARTING_WAIT_DEFAULT
        left = max(0.5, h.beats.spawned_at + wait - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(h.greeted), left)
        except asyncio.TimeoutError:
            return None
        return self.ready(time.monotonic())

    def _hand_off(self, spare: WorkerHandle, model: ModelConfig, *, began: float, estimate: int) -> bool:
        """The spare becomes `model`'s worker (False: the command could not be sent)."""
        pool, now = self.pool, time.monotonic()
        spare.adopt(model, load_clock.begin(began or now, now, spare=True, estimate=estimate), now)
        sent = pool.command(spare, p.TakeModel(spec=worker_spec(spare, pool.config, pool.ledger.path,
                                                                pool.bus.endpoints)))
        log.info("Spare %s (pid %d) takes model %s from %s", spare.worker_id, spare.pid, model.id, model.path)
        pool.on_event(SpareNews(spare, f"spare pid {spare.pid} takes model {model.id} (W1)"))
        pool.timer.began(spare)
        return sent

    def load_begins(self) -> None:
        self.loads_waiting += 1

    def load_ends(self) -> None:
        self.loads_waiting = max(0, self.loads_waiting - 1)

    # -- what the pool tells -----------------------------------------------------------

    def greeted(self, handle: WorkerHandle, now: float) -> None:
        self.start_seconds = max(0.0, now - handle.beats.spawned_at)

    def measured(self, usage: int) -> None:
        self.held = usage

    def exited(self, expected: bool, now: float) -> None:
        if not expected:
            self.deaths.append(now)

    def due(self, now: float) -> float:
        """When the next spare may start (0: now), after spares that died unasked."""
        scfg = self.pool.config.supervisor
        self.deaths = intensity.recent(self.deaths, now, scfg)
        return next_start(self.deaths, now, scfg)


def next_start(deaths: list[float], now: float, scfg: SupervisorConfig) -> float:
    """When the next spare may start (0: now), given when spares died unasked: each waits a
    backoff that doubles (supervisor.workers.intensity); past `restart_max` of them within
    `restart_period`, the end of the period of the oldest."""
    recent = intensity.recent(deaths, now, scfg)
    if not recent:
        return 0.0
    delay = intensity.respawn_delay(len(recent), scfg)
    if delay is None:
        return recent[0] + scfg.restart_period
    return recent[-1] + delay
