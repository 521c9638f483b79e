"""SPEC W5, thrash: models that evict each other, found in a log of swaps, and
what a load does about the model it must replace.

A *swap* is one model load that stopped another non-pinned model to make room
(A2). Models *thrash* when they evict each other more than `thrash_swaps`
times within `thrash_window` seconds: the set of them is a strongly connected
part of the graph "loading X stopped Y" (X -> Y) drawn from the swaps in the
window. Two models that take turns (A -> B, B -> A) are one such part; three
in rotation (B stops A, C stops B, A stops C) are one; a scan through many
models that never come back (B stops A, C stops B, D stops C) is none,
however many swaps it makes, because no model there was evicted by one it
had evicted: a hold cannot save a swap that the next request does not undo.

The hand-over says what a load does while a model it must stop still has
work (requests running or queued on its worker, or requests whose load of it
has just finished and that are about to be handed to it):

  * `hold`: the model keeps serving, new arrivals included, so that the
    requests that alternate between thrashing models are served in batches
    (W5: one swap per hold, not one per request);
  * `close`: the model takes nothing new (new requests for it wait for its
    next load) and finishes what it has; then it is stopped;
  * `go`: admission (A1-A4) decides now, as it always has;
  * `give_up`: waited `queue_deadline` for a closed model; admission decides
    now (and refuses with 507 when the model is still busy, as A3 says).

Pure: time comes in as arguments, nothing here reads a clock.

Public names (stable): Swap, Thrash, HandOver, SETTLE, thrashing, together, changes, hand_over, in_the_way,
recent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from shared.states import SERVING_STATES
from supervisor.policy.admission import admit
from supervisor.policy.snapshot import Snapshot, WorkerRecord

HandOver = Literal["hold", "close", "go", "give_up"]


class Swap(msgspec.Struct, frozen=True):
    """One load (of `loaded`) that stopped `evicted` to make room, at monotonic time `t`."""

    t: float
    loaded: str
    evicted: str


class Thrash(msgspec.Struct, frozen=True):
    """A set of models that evicted each other `swaps` times within the window."""

    models: tuple[str, ...]  # sorted
    swaps: int

    def words(self) -> str:
        return f"{', '.join(self.models)} evicted each other {self.swaps} times"


def recent(swaps: Iterable[Swap], now: float, window: float) -> list[Swap]:
    """The swaps of the last `window` seconds (the window includes its start)."""
    return [s for s in swaps if now - window <= s.t <= now]


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _components(edges: dict[str, set[str]], nodes: set[str]) -> list[set[str]]:
    """Strongly connected parts of two models or more (a handful of models: reachability suffices)."""
    reach = {n: _reach(edges, n) for n in nodes}
    parts: list[set[str]] = []
    placed: set[str] = set()
    for n in sorted(nodes):
        if n in placed:
            continue
        part = {m for m in reach[n] if n in reach[m]}
        placed |= part
        if len(part) >= 2:
            parts.append(part)
    return parts


def thrashing(swaps: Sequence[Swap], now: float, *, limit: int, window: float) -> list[Thrash]:
    """W5: the sets of models that evicted each other more than `limit` times within `window` s of `now`."""
    inside = [s for s in recent(swaps, now, window) if s.loaded != s.evicted]
    edges: dict[str, set[str]] = {}
    for s in inside:
        edges.setdefault(s.loaded, set()).add(s.evicted)
    nodes = {s.loaded for s in inside} | {s.evicted for s in inside}
    found = []
    for part in _components(edges, nodes):
        count = sum(1 for s in inside if s.loaded in part and s.evicted in part)
        if count > limit:
            found.append(Thrash(models=tuple(sorted(part)), swaps=count))
    return found


def together(groups: Iterable[Thrash], model: str, others: Iterable[str]) -> bool:
    """Whether `model` thrashes with every one of `others` (all in one set)."""
    wanted = {model, *others}
    return any(wanted <= set(g.models) for g in groups)


def changes(before: Sequence[Thrash], after: Sequence[Thrash]) -> tuple[list[Thrash], list[Thrash]]:
    """(sets that began thrashing or took in a model, sets that stopped): what an event says.

    A set whose swap count merely grew is not news: one event per episode."""
    started = [g for g in after if not any(set(g.models) <= set(b.models) for b in before)]
    ended = [b for b in before if not any(set(b.models) <= set(g.models) for g in after)]
    return started, ended


# A model whose requests all ended this recently still counts as busy: a client's next request
# comes a few milliseconds after its last answer, and two requests batched together end in the
# same step; a hold must not end in that gap (it would end a hold that W5 wants to go on).
SETTLE = 0.05
# While a hold is on, that gap is the client's whole turn: its answer read, its next request sent,
# the front door and the loop under load. On a loaded 2-core machine it passed 50 ms and ended a
# 2 s hold after 0.7 s (the full slow suite, 2026-12-05); a hold is there to span those gaps.
HOLD_SETTLE = 0.25


def hand_over(*, waited: float, quiet: float, thrashing: bool, hold: float, commit: float,
              settle: float = SETTLE, hold_settle: float = HOLD_SETTLE) -> HandOver:
    """What a load does about the models it must stop, `waited` seconds after it began asking.

    `quiet`: seconds since those models last had work (0: they have some now);
    they are busy while it is under `settle` (`hold_settle` while a hold is on:
    a client's next request is what the hold waits for). `hold` is `[guard] thrash_hold`
    (0: W5 off, admission decides at once, as before W5); `commit` the longest
    a load waits for a closed model to finish the work it has (`[supervisor]
    queue_deadline`, what a request already accepts to wait for admission).

    Thrashing: hold for up to `hold` seconds, then close and wait up to
    `commit` more. Not thrashing: close at once and wait up to `commit`, so a
    request that arrives while the other model finishes its requests is
    served after them instead of refused for them (or, before W5, failing
    theirs); a job that outlasts `commit` still gets A3's answer.
    """
    holding = thrashing and waited < hold
    if hold <= 0 or quiet >= (hold_settle if holding else settle):
        return "go"
    if holding:
        return "hold"
    return "close" if waited < (hold if thrashing else 0.0) + commit else "give_up"


def in_the_way(s: Snapshot, model_id: str, size_bytes: int) -> list[str]:
    """The workers a load of `model_id` would stop (A2) if every non-pinned model were idle.

    Admission stops idle models only and refuses a load that a busy one is in
    the way of (A3); the hand-over waits for those busy ones first, so it asks
    admission itself, with their work taken away, which it would stop. A load
    that would be refused even then waits for nobody: [] (and so does one
    that fits without stopping anyone)."""
    def shown_idle(w: WorkerRecord) -> WorkerRecord:
        if w.state in SERVING_STATES and not w.pinned and not w.marked_for_unload:
            return msgspec.structs.replace(w, state="ready", running=0, queued=0)
        return w

    verdict = admit(msgspec.structs.replace(s, workers=[shown_idle(w) for w in s.workers]), model_id, size_bytes)
    return list(verdict.evict) if verdict.admitted else []
