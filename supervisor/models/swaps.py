"""SPEC W5 carried out: swaps counted, thrash said, and the hand-over of a swap.

A swap is a load that stops another non-pinned model to make room (A2). Here:

  * every swap is logged; when some models evict each other more than
    `[guard] thrash_swaps` times within `thrash_window` seconds, a `thrash`
    event names them and the swaps (and another says when it is over);
  * before a load is admitted (inside the A5 lock, `Models._load_locked`), the
    models it would stop that still have work are handed over instead of
    being in its way: while they thrash with the model being loaded they keep
    serving (new arrivals too) for up to `thrash_hold` seconds, so a client
    that alternates pays one swap per hold; otherwise, and once the hold is
    over, they are closed (new requests for them wait for their next load)
    and finish what they have. The hold ends as soon as they have had nothing
    to do for 50 ms. The decisions are `supervisor.policy.thrash.hand_over`'s.

Why the hand-over exists at all: admission stops idle models only, and
refuses (507) a load that a busy one is in the way of; and a model whose
load has just finished has requests about to be handed to it that no
snapshot shows yet: a load that came next (the A5 lock's next waiter runs
before them) stopped it under their feet, and they failed with
`model_unloading`. A concurrent client alternating between two models that
fit only one at a time lost 8 of 12 requests that way on main at 8fb108d.
Here those requests count as the model's work (`joining`), and a busy model
in the way is waited for (at most `[supervisor] queue_deadline` once closed).

`thrash_hold = 0` turns the hand-over off: a load is admitted as before W5.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterator

from supervisor.config import Config, ModelConfig
from supervisor.doors.refusals import ModelUnreadable
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.enforcer import Enforcer
from supervisor.guard.eventlog import Emit
from supervisor.policy.thrash import Swap, Thrash, changes, hand_over, in_the_way, recent, thrashing, together
from supervisor.workers.pool import Pool
from supervisor.workers.process import WorkerHandle

log = logging.getLogger("memvisor.swaps")

# How often a load that waits for a model's work looks again (a request's end is
# seen within this; the wait itself is bounded by the hand-over's rules).
HAND_OVER_POLL = 0.02


class Swaps:
    def __init__(self, config: Config, *, pool: Pool, enforcer: Enforcer, emit: Emit,
                 counters: SupervisorCounters) -> None:
        self.config = config
        self.pool = pool
        self.enforcer = enforcer
        self.emit = emit
        self.counters = counters
        self.log: list[Swap] = []
        self.groups: list[Thrash] = []   # the sets thrashing now (W5)
        self.closed: set[str] = set()    # worker ids that take nothing new while a load waits for them
        self._joiners: collections.Counter[asyncio.Task] = collections.Counter()

    # -- requests on their way to a worker ---------------------------------------------

    @contextlib.contextmanager
    def joining(self, load: asyncio.Task) -> Iterator[None]:
        """A request waits on `load`: until it resumes, it is work of the worker the load
        gives (its command is sent in the same step as it resumes)."""
        self._joiners[load] += 1
        try:
            yield
        finally:
            self._joiners[load] -= 1
            if self._joiners[load] <= 0:
                del self._joiners[load]

    def about_to_arrive(self, handle: WorkerHandle) -> int:
        """Requests whose load of this worker has finished and that have not yet been handed to it."""
        return sum(n for load, n in self._joiners.items()
                   if load.done() and not load.cancelled() and load.exception() is None and load.result() is handle)

    def open_for(self, handle: WorkerHandle) -> bool:
        """Whether a new request may go to this worker (a closed one finishes what it has first)."""
        return handle.worker_id not in self.closed

    def has_work(self, handle: WorkerHandle) -> bool:
        """Running or queued on the worker (as admission will count it), or about to arrive there."""
        if not handle.serving or handle.stopping is not None:
            return False  # gone, or going: nothing to wait for
        sample = handle.sample
        queued = sample is not None and (sample.running > 0 or sample.queued > 0)
        return queued or self.pool.running(handle) > 0 or self.about_to_arrive(handle) > 0

    # -- a load's hand-over ----------------------------------------------------------------

    async def before_admit(self, model: ModelConfig) -> dict[str, str]:
        """Wait, as the hand-over says, for the busy models this load must stop; then the
        non-pinned serving workers (id -> model) for `after_admit` to tell the swaps by."""
        hold = self.config.guard.thrash_hold
        if hold > 0:
            await self._hand_over(model, hold)
        return {h.worker_id: h.model_id for h in self.pool.handles.values()
                if h.serving and not h.pinned and h.stopping is None}

    async def _hand_over(self, model: ModelConfig, hold: float) -> None:
        try:
            size = self.enforcer.weight_bytes(model)
        except ModelUnreadable:
            return  # admission says so next, with the reason
        snapshot = self.enforcer.snapshot(time.monotonic())
        victims = [h for w in in_the_way(snapshot, model.id, size) if (h := self.pool.handles.get(w)) is not None]
        if not any(self.has_work(h) for h in victims):
            return
        models = sorted({h.model_id for h in victims})
        thrash = together(self.groups, model.id, models)
        began = worked = time.monotonic()
        said: set[str] = set()
        try:
            while True:
                self.pool.read_samples()  # what admission will read: the workers' own latest counts
                now = time.monotonic()
                if any(self.has_work(h) for h in victims):
                    worked = now
                step = hand_over(waited=now - began, quiet=now - worked, thrashing=thrash, hold=hold,
                                 commit=self.config.supervisor.queue_deadline)
                if step in ("go", "give_up"):
                    self._done(model.id, models, step, now - began, said)
                    return
                if step not in said:
                    said.add(step)
                    self._say(model.id, models, step, hold)
                if step == "close":
                    self.closed.update(h.worker_id for h in victims)
                await asyncio.sleep(HAND_OVER_POLL)
        finally:
            self.closed.difference_update(h.worker_id for h in victims)

    def _say(self, model_id: str, models: list[str], step: str, hold: float) -> None:
        """A hold is an event (it explains a request's wait); a close is counted and logged."""
        them = ", ".join(models)
        if step == "hold":
            self.counters.thrash_holds += 1
            why = f"load of {model_id} holds up to {hold:g} s while {them} serves its queued requests (thrash)"
            log.info("%s", why)
            self.emit("thrash", why, model_id=model_id)
        else:
            self.counters.swap_waits += 1
            log.info("Load of %s: %s takes nothing new and finishes its requests first", model_id, them)

    def _done(self, model_id: str, models: list[str], step: str, waited: float, said: set[str]) -> None:
        if step == "give_up":
            self.counters.swap_waits_given_up += 1
            log.warning("Load of %s: %s still busy after %.1f s; admission decides now", model_id,
                        ", ".join(models), waited)
        elif said:
            log.info("Load of %s: %s handed over after %.2f s", model_id, ", ".join(models), waited)

    def after_admit(self, model: ModelConfig, serving: dict[str, str]) -> None:
        """The workers admission stopped for this load are its swaps (W5's count)."""
        now = time.monotonic()
        for worker_id, evicted in serving.items():
            handle = self.pool.handles.get(worker_id)
            if handle is None or handle.left_because("evict"):
                self.log.append(Swap(t=now, loaded=model.id, evicted=evicted))
                self.counters.swaps += 1
        self.tick(now, model.id)

    # -- thrash ----------------------------------------------------------------------------

    def tick(self, now: float, loaded: str = "") -> None:
        """The thrashing sets now; a set that begins or ends is said (W5's event)."""
        guard = self.config.guard
        self.log = recent(self.log, now, guard.thrash_window)
        groups = thrashing(self.log, now, limit=guard.thrash_swaps, window=guard.thrash_window)
        started, ended = changes(self.groups, groups)
        self.groups = groups
        for g in started:
            self.counters.thrash_episodes += 1
            hold = (f"a load among them lets the loaded model serve its queued requests for up to "
                    f"{guard.thrash_hold:g} s first" if guard.thrash_hold > 0 else "no hold (thrash_hold = 0)")
            why = f"{g.words()} within {guard.thrash_window:g} s (more than thrash_swaps = {guard.thrash_swaps}): {hold}"
            log.warning("Thrash: %s", why)
            self.emit("thrash", why, model_id=loaded)
        for g in ended:
            self.emit("thrash", f"{', '.join(g.models)} no longer thrash: at most {guard.thrash_swaps} swaps "
                                f"among them in the last {guard.thrash_window:g} s")
