"""The guard's policy: one pure function from a Snapshot to decisions.

`tick(snapshot) -> TickResult` decides every pressure rule of SPEC P (with the
ceilings of T and C): it reads no clock, file or socket, logs nothing and uses
no randomness, so every rule is a table test and a recorded trace replays to
the same decisions. The enforcer gathers the snapshot, carries the decisions
out in order, and runs a `recheck` tick right after acting (P7).

Projection. The policy cannot re-measure inside a tick, so it projects usage
as it decides, from the worker records:

- it starts from the measured group usage (U2) minus the usage of workers
  already `draining` (their stop is under way; counting them would evict a
  second model for memory that is about to come back) -- except at hard
  when the stops under way cannot land in time: the group grows (the sum of
  the non-draining workers' growth since an earlier tick) fast enough to
  go over the ceiling (or further over it) within STOP_SECONDS, the time a
  stop takes, by more than GROWTH_TOLERANCE of it. Then the
  draining bytes are not counted as gone and the next victim is acted on at
  once (counting them as gone measured 44-61 % over a 256 MiB ceiling while a 1 GiB/s
  grower waited for an idle model's exit). Nor are they when a worker is a
  runaway grower (more than min(1 % of the ceiling, 64 MiB) per STOP_SECONDS):
  how long a stop takes depends on the size of what is stopped, so that
  grower is acted on first, at once (waiting for a 300 MiB model's exit let a
  grower go 14.1 % over);
- a hot-cache shrink (P5) subtracts the bytes asked for, at most what each
  worker reports as releasable (blocks no request uses);
- a Stop (P6 steps 1-2) or a TTL expiry subtracts the worker's usage (the OS
  takes back the whole process);
- aborting requests or loads, marking for unload and reclaiming subtract
  nothing: how much they free is only known by measuring again.

A worker marked for unload (P6.3) is stopped as soon as it is idle, at any
level, even after the pressure has ended.

Eviction stops as soon as projected usage is at or below soft (P6). Workers
that are draining, stopped, dead or being loaded are never chosen as eviction
victims. The pressure level, P2's emergency count and the admission pause are
always decided on measured usage.

The rules live beside this module: P4-P6 in eviction.py, the limits handed to
each worker and P8's concurrency walk in worker_limits.py, spare workers (W1,
W2) in spares.py, the tick's working state in tickstate.py.

Public names (stable): tick, TickResult, group_usage, EMERGENCY_MARGIN,
EMERGENCY_TICKS, POOL_RECLAIM_FLOOR (the default of GuardSettings.pool_max),
GRACE_TICKS_MAX, plus DESTRUCTIVE and Decision re-exported from
supervisor.policy.decisions.
"""

from __future__ import annotations

import msgspec

from shared.vocab import PressureLevel
from supervisor.policy.ceilings import Ceilings, reserve_message
from supervisor.policy.decisions import (
    DESTRUCTIVE,
    Decision,
    ExpireTTL,
    LevelChanged,
    PauseAdmission,
    ResumeAdmission,
    Warn,
    size_text,
)
from supervisor.policy.device import (
    DeviceCeilings,
    device_emergency,
    device_level,
    device_reserve_message,
    worse_level,
)
from supervisor.policy.eviction import (
    GRACE_TICKS_MAX,
    POOL_RECLAIM_FLOOR,
    discount_draining,
    evict,
    grower_first,
    measure_growth,
    reclaim_grace,
    shrink_hot_cache,
    stop_marked,
)
from supervisor.policy.group import (
    EMERGENCY_MARGIN,
    EMERGENCY_TICKS,
    WorkerGroup,
    classify,
    is_idle,
    over_ceiling,
)
from supervisor.policy.snapshot import PolicyState, Snapshot, WorkerRecord
from supervisor.policy.spares import keep_spares, stop_spares
from supervisor.policy.tickstate import Tick
from supervisor.policy.worker_limits import limits_to_hand_out

__all__ = [
    "DESTRUCTIVE",
    "EMERGENCY_MARGIN",
    "EMERGENCY_TICKS",
    "GRACE_TICKS_MAX",
    "POOL_RECLAIM_FLOOR",
    "Decision",
    "TickResult",
    "group_usage",
    "tick",
]


class TickResult(msgspec.Struct, frozen=True, kw_only=True):
    """Output of one tick: the state to pass to the next, and what to do."""

    state: PolicyState
    decisions: list[Decision]
    ceilings: Ceilings
    level: PressureLevel
    usage: int              # U2 measured
    projected_usage: int    # after the decisions, as projected (see module doc)
    emergency: bool
    next_interval: float    # P9
    draining_credited: int = 0  # draining usage counted as already gone (module doc)
    # D4: the discrete device pool (None: no device); `level` above is the worse of the two pools
    device: DeviceCeilings | None = None
    device_usage: int = 0
    device_level: PressureLevel = "ok"
    device_emergency: bool = False
    host_level: PressureLevel = "ok"


def group_usage(s: Snapshot) -> int:
    """U2: supervisor footprint + the usage of every worker whose process exists."""
    return WorkerGroup(s).usage


# ---------------------------------------------------------------------------
# the rules of this module: warnings, P1-P3, P9, P10 (P4-P6: eviction.py; limits and P8: worker_limits.py)


def warnings(t: Tick) -> tuple[bool, bool]:
    """Say once what the guard cannot see or cannot give (C2, C1, D2); (no reading, reserve too large)."""
    prev, c, out = t.prev, t.c, t.out
    no_reading = c.enabled and c.tier != "custom" and c.reading == "none"
    if no_reading and not prev.no_reading_warned:
        out.append(Warn(reason="C2", message=(
            "no memory reading from this machine; the dynamic ceiling falls back to "
            f"the static one ({size_text(c.static)})")))
    if c.reserve_exceeds_total and not prev.reserve_warned:
        out.append(Warn(reason="C1", message=reserve_message(c)))
    device_short = t.dc is not None and t.dc.reserve_exceeds_total
    if device_short and not prev.reserve_warned:
        out.append(Warn(reason="D2", message=device_reserve_message(t.dc)))
    return no_reading, c.reserve_exceeds_total or device_short


def host_pressure(t: Tick) -> tuple[PressureLevel, int, bool]:
    c, usage = t.c, t.group.usage
    over, emergency = over_ceiling(usage, c.ceiling, t.prev.over_ceiling_ticks, t.s.recheck)
    return classify(usage, c.ceiling, c.soft, c.hard), over, emergency


def admission(t: Tick, level: PressureLevel) -> bool:
    paused = level != "ok"
    if paused != t.prev.admission_paused:
        if paused:
            t.out.append(PauseAdmission(reason=(
                f"{level} memory pressure: new requests wait; running ones continue")))
        else:
            t.out.append(ResumeAdmission(reason="memory pressure is over"))
    return paused


def expire_ttl(t: Tick) -> None:
    """P10: unload idle models past their TTL; pinned models never expire."""
    now, default = t.s.now, t.s.guard.idle_timeout
    for w in _with_ttl(t):
        ttl = default if w.ttl is None else w.ttl
        if ttl <= 0 or now - w.last_access <= ttl:  # cheapest test first: most never expire
            continue
        if w.pinned or w.marked_for_unload or not is_idle(w) or w.worker in t.stopped:
            continue
        idle_for = now - w.last_access
        t.out.append(ExpireTTL(worker=w.worker, model=w.model, reason=(
            f"{w.model} idle for {idle_for:.0f} s, longer than its TTL of {ttl:g} s")))
        t.gone(w)


def _with_ttl(t: Tick) -> list[WorkerRecord]:
    """The serving workers that may have a TTL (P10): every one when `idle_timeout` is set, else
    only those with one of their own. Most setups set none, and P10 then walks no worker."""
    serving = t.group.serving
    return serving if t.s.guard.idle_timeout > 0 else [w for w in serving if w.ttl is not None]


def next_interval(t: Tick, level: PressureLevel) -> float:
    """P9: fast while anything can change the answer, slow when all is quiet."""
    s, guard = t.s, t.s.guard
    hint = s.activity_hint
    hinted = hint is not None and s.now < hint + max(2.0, 2 * guard.poll_interval)
    if level != "ok" or t.group.loading or t.group.active or t.group.unknown or hinted:
        return guard.poll_interval
    quiet = guard.loaded_idle_interval if t.group.serving else guard.unloaded_idle_interval
    return min(quiet, _until_expiry(t))


def _until_expiry(t: Tick) -> float:
    """P10 at a slow cadence: wake for the next TTL expiry (a second at the finest), not 10 s late."""
    now, default, fine = t.s.now, t.s.guard.idle_timeout, t.s.guard.poll_interval
    soonest = float("inf")
    for w in _with_ttl(t):
        ttl = default if w.ttl is None else w.ttl
        if w.pinned or w.marked_for_unload or ttl <= 0 or w.worker in t.stopped:
            continue
        left = ttl - (now - w.last_access) + 0.01
        if left < soonest:
            soonest = left
    # the finest cadence applied once to the soonest: the same as to each (max is monotone),
    # without two builtin calls a worker on every quiet tick
    return soonest if soonest > fine else fine


def _hold_still(s: Snapshot, t: Tick) -> TickResult:
    """The guard is on but no reading has ever given the machine's size:
    decide nothing but say so.

    Guessing a size would either lift every limit or (static = 1 byte) make
    the guard evict everything; holding still until a reading arrives does
    neither. The last limits handed out stay in force in the workers.
    """
    prev = s.state
    decisions: list[Decision] = []
    if not prev.no_reading_warned:
        decisions.append(Warn(reason="C2", message=(
            "no memory reading from this machine and no earlier one: the guard takes "
            "no action until it can read how much memory there is")))
    state = msgspec.structs.replace(prev, no_reading_warned=True, interval=s.guard.poll_interval)
    return TickResult(state=state, decisions=decisions, ceilings=t.c, level=prev.level,
                      usage=t.group.usage, projected_usage=t.projected, emergency=False,
                      next_interval=s.guard.poll_interval, draining_credited=t.credited)


def tick(s: Snapshot) -> TickResult:
    """Decide one tick. Pure: the same snapshot always gives the same result.

    Order of the decisions: warnings, level change, admission pause/resume,
    limits and P8's concurrency steps (one decision per worker, each with its
    whole limits), W2 stops of spares (any pressure), P6.1 stops of drained
    marked workers (any level), P4 grace reclaim or P5/P6 pressure actions
    (host pool, then device pool: D4), P10 TTL expiries, W1 a spare's start.
    """
    t = Tick(s)
    if s.host is None and s.state.last_total <= 0 and s.guard.enabled:
        return _hold_still(s, t)
    c, dc, prev = t.c, t.dc, s.state
    no_reading, reserve_warned = warnings(t)
    host_level, over, host_emergency = host_pressure(t)
    dev_usage = t.group.device_bytes
    dev_level: PressureLevel = "ok"
    if dc is None:  # no device pool (most machines): the host's figures are the group's
        dev_over, dev_emergency = 0, False
        level, emergency = host_level, host_emergency
    else:
        dev_level = device_level(dev_usage, dc)
        dev_over, dev_emergency = device_emergency(dev_usage, dc, prev.device_over_ceiling_ticks, recheck=s.recheck)
        level = worse_level(host_level, dev_level)  # D4: the group's level is the worse pool's
        emergency = host_emergency or dev_emergency
    if level != prev.level:
        t.out.append(_level_changed(prev.level, level, t, host_level, dev_usage))
    paused = admission(t, level)
    common, limited, cache_kept, reduced = limits_to_hand_out(t, paused, level, host_level)
    seen, seen_at, growth = measure_growth(t)
    discount_draining(t, host_level, growth)
    t.host.projected -= t.cache_drop_bytes  # C12's cache drop, asked in limits_to_hand_out
    stop_spares(t, level)  # W2: spares before anything else, at any pressure
    stop_marked(t, level)
    grace = 0 if level == "ok" else prev.grace_ticks
    if level != "ok":
        # a runaway grower at hard is not given a grace tick: it would grow through it
        if not t.growers and reclaim_grace(t, level, emergency):
            grace += 0 if s.recheck else 1
        else:
            pools = [(t.host, host_level, host_emergency)]
            if t.device is not None:
                pools.append((t.device, dev_level, dev_emergency))
            for pool, pool_level, pool_emergency in pools:
                if pool_level == "ok":
                    continue
                acting: PressureLevel = pool_level
                stepped = pool is t.host and grower_first(t, pool_emergency)
                if pool_level == "hard":
                    shrink_hot_cache(t, pool)
                    acting = pool.classify()
                evict(t, pool, acting, pool_emergency, stepped=stepped)
    expire_ttl(t)
    keep_spares(t, level)  # W1: in the quiet after loads and requests, with room
    interval = next_interval(t, level)
    # positionally, in field order: 17 keywords cost a dict built and unpacked per call (PolicyState)
    state = PolicyState(
        level, over, grace, paused, no_reading, reserve_warned, t.total, interval,
        common, limited, cache_kept, reduced, t.caps, seen, seen_at, growth, dev_over)
    return TickResult(state=state, decisions=t.out, ceilings=c, level=level, usage=t.group.usage,
                      projected_usage=t.projected, emergency=emergency, next_interval=interval,
                      draining_credited=t.credited, device=dc, device_usage=dev_usage,
                      device_level=dev_level, device_emergency=dev_emergency, host_level=host_level)


def _level_changed(before: PressureLevel, level: PressureLevel, t: Tick, host_level: PressureLevel, dev_usage: int) -> LevelChanged:
    """P1/D4: the figures of the pool that sets the group's level (the host on a tie)."""
    c, dc = t.c, t.dc
    if dc is None or level == host_level:
        return LevelChanged(from_level=before, to_level=level, usage=t.group.usage, soft=c.soft, hard=c.hard,
                            ceiling=c.ceiling, reason=_level_reason(level, t.group.usage, c))
    return LevelChanged(
        from_level=before, to_level=level, usage=dev_usage, soft=dc.soft, hard=dc.hard, ceiling=dc.ceiling,
        pool="device", reason=(
            f"device usage {size_text(dev_usage)} against soft {size_text(dc.soft)}, hard "
            f"{size_text(dc.hard)}, device ceiling {size_text(dc.ceiling)} ({dc.binding})"))


def _level_reason(level: PressureLevel, usage: int, c: Ceilings) -> str:
    if c.ceiling <= 0:
        return "the guard is off: no limit"
    return (f"usage {size_text(usage)} against soft {size_text(c.soft)}, hard "
            f"{size_text(c.hard)}, ceiling {size_text(c.ceiling)} ({c.binding})")
