"""What the guard's policy asks the enforcer to do (one tagged union).

Each decision is a msgspec Struct tagged by `kind`, carrying a `reason`
written for people: the enforcer logs it and publishes it as an S2 event.
Worker-directed decisions name the worker id and, for readable events and
replay output, its model id. The enforcer carries them out in list order.

Public names (stable): Decision and WorkerDecision (the unions), every class below, DESTRUCTIVE,
DecisionKind, kind_of, per_worker, LimitsEntry and size_text. The policy tick hands out limits as
one `HandOutLimits`; `per_worker` spells it out as the `ApplyLimits` and `SetConcurrency` it stands for.
"""

from __future__ import annotations

from typing import Literal, Union, cast, get_args

import msgspec

from shared.limits import Limits
from shared.sizes import format_size
from shared.vocab import PoolName, PressureLevel


class _Base(msgspec.Struct, tag_field="kind", frozen=True, kw_only=True, gc=False):
    reason: str = ""


class _ForWorker(_Base, frozen=True, kw_only=True, gc=False):
    worker: str
    model: str = ""


class Warn(_Base, tag="warn", frozen=True, kw_only=True, gc=False):
    """One log line a person must see once (T2 unknown tier, C1, C2 no reading)."""

    message: str


class LevelChanged(_Base, tag="level_changed", frozen=True, kw_only=True, gc=False):
    """P1: the pressure level moved; carries the figures (of `pool`, D4) that moved it."""

    from_level: PressureLevel = msgspec.field(name="from")
    to_level: PressureLevel = msgspec.field(name="to")
    usage: int
    soft: int
    hard: int
    ceiling: int
    pool: PoolName = "host"  # D4: the pool that sets the group's level


class PauseAdmission(_Base, tag="pause_admission", frozen=True, kw_only=True, gc=False):
    """P3: queue new requests; running ones continue, an idle worker still takes one."""


class ResumeAdmission(_Base, tag="resume_admission", frozen=True, kw_only=True, gc=False):
    """P3: pressure is over; take new requests again."""


class ApplyLimits(_ForWorker, tag="set_limits", frozen=True, kw_only=True, gc=False):
    """SPEC G / T6: the limits this worker's prefill guard must obey from now on: all of them,
    its concurrency cap (P8) included; the enforcer sends them as they are."""

    limits: Limits


LimitsEntry = tuple[str, str, Limits, str, bool]
"""One worker's part of a `HandOutLimits`: (worker, model, limits, reason, step). `step`: a P8 step of
its cap (`SetConcurrency`, the cap is `limits.max_concurrency`), else an `ApplyLimits`."""


class HandOutLimits(_Base, tag="hand_out_limits", frozen=True, kw_only=True, gc=False):
    """T6/P8 for every worker told something this tick, in one decision, in worker order.

    Each entry is what an `ApplyLimits` or a `SetConcurrency` says of one
    worker (`spelt_out` gives those back, in the same order). One decision
    for the lot: a Struct built, matched and freed per worker was a sixth
    of a policy tick under pressure at 64 workers, for limits most workers share.
    """

    entries: list[LimitsEntry]

    def spelt_out(self) -> list[ApplyLimits | SetConcurrency]:
        """The same limits as one decision per worker, in order (replay, tests, the fingerprint)."""
        return [SetConcurrency(worker=w, model=m, limits=lim, cap=lim.max_concurrency, reason=why) if step
                else ApplyLimits(worker=w, model=m, limits=lim, reason=why) for w, m, lim, why, step in self.entries]


class ReclaimPool(_ForWorker, tag="reclaim", frozen=True, kw_only=True, gc=False):
    """Return the MLX pool to the OS: at the next step boundary (P4, P5) or,
    with `idle_only`, the next time the worker is idle (P6 step 6)."""

    idle_only: bool = False


class ShrinkHotCache(_ForWorker, tag="shrink_hot_cache", frozen=True, kw_only=True, gc=False):
    """P5: drop LRU prompt/KV cache blocks until the cache holds `target_bytes`,
    never a block a running or queued request uses."""

    target_bytes: int


class AbortWorkerRequests(_ForWorker, tag="abort_requests", frozen=True, kw_only=True, gc=False):
    """P6 steps 3 and 5: abort the worker's running and queued requests, keep it loaded."""


class AbortLoad(_ForWorker, tag="abort_load", frozen=True, kw_only=True, gc=False):
    """P6 step 4: abort a model load in progress (the pool moves it to draining)."""


class MarkForUnload(_ForWorker, tag="mark_for_unload", frozen=True, kw_only=True, gc=False):
    """P6 step 3 in emergency: take nothing new; stop the worker once it has drained."""


class Stop(_ForWorker, tag="stop", frozen=True, kw_only=True, gc=False):
    """P6 steps 1-2: stop the worker process; the OS takes back every byte it held."""


class SetConcurrency(_ForWorker, tag="set_concurrency", frozen=True, kw_only=True, gc=False):
    """P8: the worker's cap on concurrent sequences, one step per tick, and its whole limits
    with that cap (`limits.max_concurrency == cap`): the enforcer sends them as they are."""

    cap: int
    limits: Limits


class ExpireTTL(_ForWorker, tag="expire_ttl", frozen=True, kw_only=True, gc=False):
    """P10: the model sat idle longer than its TTL; unload it."""


class StartSpare(_Base, tag="start_spare", frozen=True, kw_only=True, gc=False):
    """W1: start one spare worker (MLX and the engine imported, no model)."""


class StopSpare(_ForWorker, tag="stop_spare", frozen=True, kw_only=True, gc=False):
    """W2: under pressure, a spare worker is the first thing stopped."""


# Decisions that name one worker; the enforcer carries each out on that worker.
WorkerDecision = Union[
    ApplyLimits,
    ReclaimPool,
    ShrinkHotCache,
    AbortWorkerRequests,
    AbortLoad,
    MarkForUnload,
    Stop,
    SetConcurrency,
    ExpireTTL,
    StopSpare,
]

Decision = Union[
    Warn,
    LevelChanged,
    PauseAdmission,
    ResumeAdmission,
    StartSpare,
    HandOutLimits,
    WorkerDecision,
]

# Every decision's tag, as a closed vocabulary (the lab's timeline and its picture name them).
DecisionKind = Literal["warn", "level_changed", "pause_admission", "resume_admission", "hand_out_limits",
                       "set_limits", "reclaim",
                       "shrink_hot_cache", "abort_requests", "abort_load", "mark_for_unload", "stop",
                       "set_concurrency", "expire_ttl", "start_spare", "stop_spare"]

assert set(get_args(DecisionKind)) == {c.__struct_config__.tag for c in get_args(Decision)}, "one kind per decision"


def kind_of(decision: Decision) -> DecisionKind:
    """The decision's tag (checked above to be one of DecisionKind)."""
    return cast(DecisionKind, decision.__struct_config__.tag)


def per_worker(decisions: list[Decision]) -> list[Decision]:
    """`decisions` with each `HandOutLimits` spelt out, in place, as one decision per worker."""
    out: list[Decision] = []
    for x in decisions:
        if isinstance(x, HandOutLimits):
            out.extend(x.spelt_out())
        else:
            out.append(x)
    return out


# Decisions that take memory back from running work (pressure actions). TTL
# expiry is not among them: it only ever unloads an idle model by config.
DESTRUCTIVE = (ShrinkHotCache, AbortWorkerRequests, AbortLoad, MarkForUnload, Stop)


_SIZE_TEXTS: dict[int, str] = {}
_SIZE_TEXTS_MAX = 1024


def size_text(nbytes: int) -> str:
    """`format_size` for the reasons the tick writes, remembered (the same text for the same bytes).

    A tick under pressure writes the same few sizes into its reasons tick
    after tick (the watermarks, a fixed ceiling, a cache's size); formatting
    one took about 0.5 us, 8 % of a tick at 64 workers. Emptied when full,
    so sizes that never repeat (projected usage) cannot grow it; still pure:
    no input changes what any call returns. (A dict, not functools.lru_cache:
    the policy imports nothing beyond its allow-list, tests/test_rooms.py.)
    """
    text = _SIZE_TEXTS.get(nbytes)
    if text is None:
        if len(_SIZE_TEXTS) >= _SIZE_TEXTS_MAX:
            _SIZE_TEXTS.clear()
        text = _SIZE_TEXTS[nbytes] = format_size(nbytes)
    return text
