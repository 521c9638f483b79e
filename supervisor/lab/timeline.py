"""What a lab run (or a replayed trace) did, over time: one plain record.

Times are seconds since the start of the run. `points` are the group's
measured usage with each worker's share and the guard's figures at that
moment; `marks` are decisions carried out and events published (S2). The
record is a msgspec Struct so `lab --json` and the tests read the same thing
the picture is drawn from.

Public names (stable): Point, Mark, Timeline, Recorder.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Literal

import msgspec

from shared import protocol as p
from shared.vocab import GuardEventKind, PressureLevel
from supervisor.policy.decisions import DecisionKind, kind_of

if TYPE_CHECKING:
    from supervisor.arbiter import Arbiter


class Point(msgspec.Struct, frozen=True, array_like=True):
    t: float
    usage: int                  # U2: supervisor + workers
    workers: dict[str, int]     # label (model/worker) -> U1 usage
    ceiling: int
    soft: int
    hard: int
    level: PressureLevel


# A step of a scenario itself, marked beside the guard's events.
NoteKind = Literal["load", "ceiling", "drill", "request", "sigkill"]
EventMarkKind = Literal[GuardEventKind, NoteKind]
MarkKind = Literal[EventMarkKind, DecisionKind]


class Mark(msgspec.Struct, frozen=True):
    t: float
    kind: MarkKind  # a decision carried out (stop, abort_requests, ...), an event (spawn, crash, ...) or a note
    label: str      # the model it concerns, or ""
    reason: str = ""
    decision: bool = False   # True: a policy decision carried out; False: an event


class Timeline(msgspec.Struct):
    name: str
    points: list[Point] = []
    marks: list[Mark] = []

    def decisions(self, kind: DecisionKind | None = None, label: str | None = None) -> list[Mark]:
        return [m for m in self.marks if m.decision and (kind is None or m.kind == kind)
                and (label is None or m.label == label)]

    def events(self, kind: EventMarkKind | None = None, label: str | None = None) -> list[Mark]:
        return [m for m in self.marks if not m.decision and (kind is None or m.kind == kind)
                and (label is None or m.label == label)]

    def peak_over_ceiling(self, after: float = 0.0) -> float:
        """Largest (usage - ceiling) / ceiling seen after `after`; 0 when never over."""
        worst = 0.0
        for pt in self.points:
            if pt.t >= after and pt.ceiling > 0:
                worst = max(worst, (pt.usage - pt.ceiling) / pt.ceiling)
        return worst


def _same(a: Point, b: Point) -> bool:
    return (a.usage, a.workers, a.ceiling, a.soft, a.hard, a.level) == (b.usage, b.workers, b.ceiling, b.soft,
                                                                        b.hard, b.level)


class Recorder:
    """Samples a running Arbiter every `period` seconds, and hooks its events.

    Worker usage is read from the ledger (what the workers last wrote, the
    same value the enforcer reads), so the record is finer than the guard's
    own ticks.
    """

    def __init__(self, arb: Arbiter, name: str, period: float = 0.01) -> None:
        self.arb = arb
        self.period = period
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.timeline = Timeline(name=name)
        self._last_executed = self.t0  # monotonic time of the last decision taken in
        self._task: asyncio.Task | None = None
        arb.service.add_event_hook(self._on_event)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> Timeline:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._take_decisions()
        self.timeline.marks.sort(key=lambda m: m.t)
        return self.timeline

    def note(self, kind: NoteKind, label: str = "", reason: str = "") -> None:
        """A step of the scenario itself (a drill started, a ceiling set)."""
        self.timeline.marks.append(Mark(self.now(), kind, label, reason))

    def _on_event(self, ev: p.GuardEvent) -> None:
        if ev.kind in ("level", "admission"):
            label = ev.reason.split(":")[0]
        else:
            label = ev.model_id
        self.timeline.marks.append(Mark(ev.t - self.wall0, ev.kind, label, ev.reason))
        self.sample()  # a point at every event: a level that lasts a millisecond still shows

    def _take_decisions(self) -> None:
        fresh = [(t, x) for t, x in list(self.arb.enforcer.executed) if t > self._last_executed]
        if fresh:
            self._last_executed = fresh[-1][0]
        for t, x in fresh:
            self.timeline.marks.append(Mark(t - self.t0, kind_of(x), x.model, x.reason, decision=True))

    async def _run(self) -> None:
        while True:
            self.sample()
            self._take_decisions()
            await asyncio.sleep(self.period)

    def sample(self) -> None:
        arb = self.arb
        last, snap = arb.enforcer.last, arb.enforcer.last_snapshot
        if last is None or snap is None:
            return
        workers: dict[str, int] = {}
        total = snap.supervisor_footprint
        for h in list(arb.pool.handles.values()):
            s = arb.ledger.read_sample(h.slot)
            if s is None or s.pid != h.pid:
                continue
            name = h.model_id or "spare"  # W1: a spare has no model yet
            label = name if name not in workers else f"{name}#{h.worker_id}"
            workers[label] = s.memory.usage
            total += s.memory.usage
        c = last.ceilings
        point = Point(self.now(), total, workers, c.ceiling, c.soft, c.hard, last.level)
        points = self.timeline.points
        if len(points) >= 2 and _same(points[-1], point) and _same(points[-2], point):
            points[-1] = point  # a flat stretch: keep its ends only (the record stays small)
        else:
            points.append(point)


# Decisions a replayed trace does not mark: they are carried out every tick and change no memory.
_NOT_MARKED: frozenset[DecisionKind] = frozenset({"set_limits", "set_concurrency"})  # HandOutLimits: below


def timeline_from_trace(lines, name: str, *, chained: bool = True) -> Timeline:
    """A `serve --trace` recording as a Timeline: each snapshot ticked again
    (chained like the live enforcer), its measured usage and every decision.

    A bad line is skipped (`replay` reports it); times are from the first line.
    """
    from supervisor.policy.decisions import (
        HandOutLimits,
        LevelChanged,
        PauseAdmission,
        ResumeAdmission,
        StartSpare,
        Warn,
    )
    from supervisor.policy.pressure import tick
    from supervisor.policy.snapshot import Snapshot

    decoder = msgspec.json.Decoder(Snapshot)
    timeline = Timeline(name=name)
    state = None
    t0: float | None = None
    for raw in lines:
        if not raw.strip():
            continue
        try:
            snap = decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if chained and state is not None:
            snap = msgspec.structs.replace(snap, state=state)
        result = tick(snap)
        state = result.state
        t0 = snap.now if t0 is None else t0
        t = snap.now - t0
        workers = {w.model: w.usage for w in snap.workers if w.state not in ("stopped", "dead")}
        c = result.ceilings
        timeline.points.append(Point(t, result.usage, workers, c.ceiling, c.soft, c.hard, result.level))
        for x in result.decisions:
            match x:
                case LevelChanged():
                    timeline.marks.append(Mark(t, "level", x.to_level, x.reason))
                case PauseAdmission() | ResumeAdmission() | Warn() | StartSpare() | HandOutLimits():
                    continue
                case _:
                    kind = kind_of(x)
                    if kind not in _NOT_MARKED:
                        timeline.marks.append(Mark(t, kind, x.model, x.reason, decision=True))
    return timeline
