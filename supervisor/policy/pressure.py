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
  once (issue 9 measured 44-61 % over a 256 MiB ceiling while a 1 GiB/s
  grower waited for an idle model's exit). Nor are they when a worker is a
  runaway grower (more than min(1 % of the ceiling, 64 MiB) per STOP_SECONDS):
  how long a stop takes depends on the size of what is stopped, so that
  grower is acted on first, at once (issue 21: a 300 MiB model's exit let a
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

Public names (stable): tick, TickResult, group_usage, EMERGENCY_MARGIN,
EMERGENCY_TICKS, POOL_RECLAIM_FLOOR (the default of GuardSettings.pool_max),
GRACE_TICKS_MAX, plus the decisions
re-exported from supervisor.policy.decisions.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from shared.limits import Limits
from shared.sizes import GiB, MiB, format_size
from shared.states import LOADING_STATES as _LOADING_STATES
from shared.vocab import PressureLevel
from supervisor.policy.ceilings import Ceilings, limits_for, reserve_message, worker_limit
from supervisor.policy.decisions import (
    DESTRUCTIVE,
    AbortLoad,
    AbortWorkerRequests,
    ApplyLimits,
    Decision,
    ExpireTTL,
    LevelChanged,
    MarkForUnload,
    PauseAdmission,
    ReclaimPool,
    ResumeAdmission,
    SetConcurrency,
    ShrinkHotCache,
    Stop,
    Warn,
)
from supervisor.policy.device import (
    DeviceCeilings,
    device_ceilings_for,
    device_emergency,
    device_level,
    device_reserve_message,
    worse_level,
)
from supervisor.policy.group import (
    EMERGENCY_MARGIN,
    EMERGENCY_TICKS,
    WorkerGroup,
    ceilings_for,
    classify,
    is_idle,
    lru_key,
    over_ceiling,
    snapshot_total,
)
from supervisor.policy.snapshot import PolicyState, Snapshot, WorkerRecord
from supervisor.policy.tiers import normalise_tier

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

POOL_RECLAIM_FLOOR = 2 * GiB     # P4 default ([guard] pool_max): a smaller pool is not worth a clear
GRACE_TICKS_MAX = 5              # P4: at 1 s a tick, covers one ~5 s prefill chunk
STOP_SECONDS = 0.3               # P6 at hard: how long a stop under way takes (measured 0.13 s idle)
GROWTH_WINDOW = 0.05             # shortest span a growth estimate is taken over (sample jitter)
DEVICE_OVERHEAD_STEP = 256 * MiB  # D4: the device watermarks handed to workers move in these steps
GROWTH_TOLERANCE = 0.01          # of the ceiling: growth during a stop below this is jitter, not a runaway
GROWER_BYTES = 64 * MiB          # ... and at most this much: on a large ceiling 1 % is a lot of growth


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


class _Pool:
    """One memory pool as this tick projects it: host RAM, or a discrete device (D4).

    P5 and P6 run on whichever pool is under pressure, with that pool's
    watermarks, choosing victims by the bytes they `held` there.
    """

    __slots__ = ("name", "soft", "hard", "ceiling", "projected", "held")

    def __init__(self, name: str, soft: int, hard: int, ceiling: int, projected: int,
                 held: Callable[[WorkerRecord], int]) -> None:
        self.name, self.soft, self.hard, self.ceiling = name, soft, hard, ceiling
        self.projected, self.held = projected, held

    @property
    def usage_words(self) -> str:
        return "usage" if self.name == "host" else "device usage"

    def classify(self) -> PressureLevel:
        """P1 on the projected usage (after P5's shrink, before P6 acts)."""
        return classify(self.projected, self.ceiling, self.soft, self.hard)


def _host_bytes(w: WorkerRecord) -> int:
    return w.usage


def _device_bytes(w: WorkerRecord) -> int:
    return w.device_bytes


class _Tick:
    """The working state of one tick; methods are the rules, in SPEC order."""

    def __init__(self, s: Snapshot) -> None:
        self.s = s
        self.prev = s.state
        self.out: list[Decision] = []
        self.g = WorkerGroup(s)
        self.tier_known = normalise_tier(s.guard.tier)[1]
        self.total = snapshot_total(s)
        self.c = ceilings_for(s, self.g)
        self.stopped: set[str] = set()
        c, g = self.c, self.g
        self.host = _Pool("host", c.soft, c.hard, c.ceiling, g.usage - g.draining_usage, _host_bytes)
        self.dc = device_ceilings_for(s, g)
        dc = self.dc
        self.device = None if dc is None else _Pool(
            "device", dc.soft, dc.hard, dc.ceiling, g.device_bytes - g.draining_device_bytes, _device_bytes)
        self.credited = self.g.draining_usage
        self.rates: dict[str, float] = {}  # bytes/s of each worker that grew (growth)
        self.cache_dropped: set[str] = set()  # workers told to drop their caches for C12
        self.cache_drop_bytes = 0  # ... and the bytes that takes off the projection
        self.growers: list[WorkerRecord] = []  # runaway growers at hard (discount_draining)

    @property
    def projected(self) -> int:
        return self.host.projected

    # -- warnings (T2, C1, C2) --------------------------------------------

    def warnings(self) -> tuple[str | None, bool, bool]:
        s, prev, c, out = self.s, self.prev, self.c, self.out
        tier_warned = prev.tier_warned
        if self.tier_known:
            tier_warned = None
        elif s.guard.tier != tier_warned:
            tier_warned = s.guard.tier
            out.append(Warn(reason="T2", message=(
                f"unknown memory guard tier {s.guard.tier!r}; using 'balanced' "
                "(choose safe, balanced, aggressive or custom)")))
        no_reading = c.enabled and c.tier != "custom" and c.reading == "none"
        if no_reading and not prev.no_reading_warned:
            out.append(Warn(reason="C2", message=(
                "no memory reading from this machine; the dynamic ceiling falls back to "
                f"the static one ({format_size(c.static)})")))
        if c.reserve_exceeds_total and not prev.reserve_warned:
            out.append(Warn(reason="C1", message=reserve_message(c)))
        device_short = self.dc is not None and self.dc.reserve_exceeds_total
        if device_short and not prev.reserve_warned:
            out.append(Warn(reason="D2", message=device_reserve_message(self.dc)))
        return tier_warned, no_reading, c.reserve_exceeds_total or device_short

    # -- P1 / P2 ----------------------------------------------------------------

    def pressure(self) -> tuple[PressureLevel, int, bool]:
        c, usage = self.c, self.g.usage
        over, emergency = over_ceiling(usage, c.ceiling, self.prev.over_ceiling_ticks, self.s.recheck)
        return classify(usage, c.ceiling, c.soft, c.hard), over, emergency

    # -- P3 and limits (T6) -----------------------------------------------------

    def admission(self, level: PressureLevel) -> bool:
        paused = level != "ok"
        if paused != self.prev.admission_paused:
            if paused:
                self.out.append(PauseAdmission(reason=(
                    f"{level} memory pressure: new requests wait; running ones continue")))
            else:
                self.out.append(ResumeAdmission(reason="memory pressure is over"))
        return paused

    def limits(self, paused: bool, level: PressureLevel) -> tuple[Limits, dict[str, int], int, dict[str, int]]:
        """Hand every worker the limits it does not have yet (T6: next tick at the latest).

        The common limits (nothing subtracted) and the caches' total are
        compared with the last ones handed out; a worker also gets its limits
        when it is new, its pid changed (a respawn) or the other workers'
        cache bytes (the total less its own) changed: its limits subtract them (C12).
        Returns (common, worker -> pid, caches' total, worker -> own cache
        bytes) for the next tick.

        When none of those changed (the common case: a quiet tick), no worker
        needs anything, and that is told by comparing the records whole
        rather than worker by worker.
        """
        g, prev, live, c = self.s.guard, self.prev, self.g.live, self.c
        # H2: an equal share of the budget in force per worker that keeps a cache
        # (a draining worker is on its way out), recomputed as they come and go
        keepers = len(live) - self.g.draining_count
        cache_cap = c.hot_cache_budget // keepers if c.hot_cache_budget > 0 and keepers else 0
        common = limits_for(c, admission_paused=paused, safe_zone_ratio=g.safe_zone_ratio,
                            min_chunk_tokens=g.min_chunk_tokens, cache_cap=cache_cap,
                            pool_max=g.pool_max, others_cache=0)
        if self.dc is not None and self.dc.ceiling > 0:  # D4: workers report device crossings at once
            common = self._device_watermarks(common, self.dc)
        had, had_own = prev.limited, prev.reduced
        total, own = self._cache_reductions(level)
        changed = common != prev.limits
        pids, before = self.g.pids, prev.cache_kept
        if not changed and pids == had and total == before and own == had_own:
            return common, had, total, had_own
        why = ("first limits" if prev.limits is None else "limits changed") if changed else ""
        needing = live if changed else [  # the common limits changed: every worker needs them
            w for w in live if had.get(w.worker) != w.pid
            or total - own.get(w.worker, 0) != before - had_own.get(w.worker, 0)]
        if not needing and len(had) == len(live) and total == before and own == had_own:
            return common, had, total, had_own
        by_key: dict[tuple[int, int], Limits] = {}
        out = self.out
        for w in needing:
            cap, mine = w.concurrency or w.max_concurrency, own.get(w.worker, 0)
            limits = by_key.get((cap, mine))
            if limits is None:
                limits = by_key[(cap, mine)] = self._worker_limits(common, cap, total - mine)
            out.append(ApplyLimits(worker=w.worker, model=w.model, limits=limits, reason=(
                why or ("new worker" if had.get(w.worker) != w.pid else "other workers' prompt caches changed"))))
        return common, pids, total, own

    def _cache_reductions(self, level: PressureLevel) -> tuple[int, dict[str, int]]:
        """C12: (the caches' bytes, each worker's own): its limits subtract the difference.

        When the caches leave no room under the ceiling for the group's next
        step (ceiling - every cache <= usage), they give way (H3): at hard P5
        shrinks them this tick; below hard the least recently used entries no
        request uses are dropped now (`ShrinkHotCache`; the worker then
        reports at once) until there is room. What is asked to go is not
        subtracted, and a limit is never brought down to a meaningless value
        (`worker_limit`).
        """
        c, g = self.c, self.g
        used = g.hot_used
        if used <= 0 or c.ceiling <= 0:
            return 0, {}
        own = {w.worker: w.memory.cache_bytes for w in g.cached}
        if c.ceiling - used <= g.usage:
            self._give_way(own, level)
            used = sum(own.values())
        return used, own

    def _give_way(self, keeps: dict[str, int], level: PressureLevel) -> None:
        """H3 for C12: lower `keeps` to the cache bytes each worker keeps once the caches make room."""
        g = self.g
        movable = [w for w in g.cached if w.memory.cache_releasable > 0 and w.state != "draining"]
        if level == "hard":  # P5 shrinks toward soft this tick (H3)
            for w in movable:
                keeps[w.worker] -= min(w.memory.cache_releasable, keeps[w.worker])
            return
        # dropping x bytes lowers usage and the caches alike: room once x > (caches + usage - ceiling) / 2
        need = (sum(keeps.values()) + g.usage - self.c.ceiling) // 2 + 1
        why = ""
        for w in sorted(movable, key=lru_key):
            take = min(w.memory.cache_releasable, keeps[w.worker], need)
            if take <= 0:
                continue
            keeps[w.worker] -= take
            why = why or (f"the prompt caches ({format_size(g.hot_used)}) leave no room under the ceiling "
                          f"({format_size(self.c.ceiling)}) for the next step")
            self.out.append(ShrinkHotCache(
                worker=w.worker, model=w.model, target_bytes=keeps[w.worker],
                reason=f"{why}: drop {format_size(take)}"))
            self.cache_dropped.add(w.worker)
            self.cache_drop_bytes += take
            need -= take
            if need <= 0:
                return

    @staticmethod
    def _worker_limits(common: Limits, cap: int, others: int) -> Limits:
        """One worker's limits: the common ones, its concurrency cap, less `others` (C12)."""
        if not others:
            return msgspec.structs.replace(common, max_concurrency=cap)
        return msgspec.structs.replace(common, max_concurrency=cap,
                                       hard_limit=worker_limit(common.hard_limit, others),
                                       abort_limit=worker_limit(common.abort_limit, others))

    def _device_watermarks(self, common: Limits, dc: DeviceCeilings) -> Limits:
        """The device pool's watermarks in the workers' own measure (D1's fallback).

        A worker can only sum MLX active + pool from the ledger; NVML also
        counts each process's CUDA context (about half a GiB), which MLX does
        not see. The watermarks go out lowered by that overhead, so a worker's
        report comes at the crossing the enforcer will see, not half a GiB
        late. Rounded down to DEVICE_OVERHEAD_STEP so the limits (and a
        ApplyLimits to every worker) do not change with every tick's jitter.
        """
        mlx = sum(w.memory.mlx_active + w.memory.mlx_pool for w in self.g.live if w.device_bytes)
        overhead = max(0, self.g.device_bytes - mlx) // DEVICE_OVERHEAD_STEP * DEVICE_OVERHEAD_STEP
        return msgspec.structs.replace(common, device_soft=max(1, dc.soft - overhead),
                                       device_hard=max(1, dc.hard - overhead))

    def growth(self) -> tuple[dict[str, int], float, float]:
        """(usage_seen, seen_at, bytes/s): how fast the non-draining workers grow.

        The rate is taken against a baseline at least GROWTH_WINDOW old when
        there is one: a tick sooner than that (a P7 recheck, a burst of
        watermark wake-ups) measures from the older baseline and keeps it.
        The span is floored at GROWTH_WINDOW, so sample jitter over a few ms
        is never read as a fast rate -- but a real burst is measured at
        once. (Issue 21: keeping the previous estimate instead let a 1 GiB/s
        grower that crossed soft and hard within 50 ms ride on the rate
        measured before it started, and the stop under way was credited.)
        Sets `self.rates`: each non-draining worker's own rate (grower_first).
        """
        prev, now = self.prev, self.s.now
        current = self.g.usage_now
        seen, span = prev.usage_seen, now - prev.seen_at
        if not seen or span < 0:
            return current, now, 0.0
        per = max(span, GROWTH_WINDOW)
        rates = {} if current == seen else {  # nothing moved (a quiet tick): no rate to work out
            k: (u - seen[k]) / per for k, u in current.items() if k in seen and u > seen[k]}
        self.rates = rates
        grew = sum(rates.values())
        if span < GROWTH_WINDOW:
            return seen, prev.seen_at, grew
        return current, now, grew

    def discount_draining(self, level: PressureLevel, growth: float) -> None:
        """At hard, stops under way count as done only when they land before the ceiling.

        (Without a stop under way, P4-P6 apply as written.) They do not when the group grows fast enough to pass the ceiling
        (further, if it is over) within STOP_SECONDS by more than a 1 %
        tolerance, nor when any worker is a runaway grower (`_growers`):
        how long a stop takes depends on the size of what is stopped and on
        the machine, so no guess of it may let a grower run on (issue 21).
        Without growth, stopping more models would not bring the memory back sooner.
        """
        c, g = self.c, self.g
        if level != "hard" or not g.draining_usage:
            self.credited = g.draining_usage
            return
        self.growers = self._growers()
        room = max(0, c.ceiling - g.usage) + c.ceiling * GROWTH_TOLERANCE
        if growth * STOP_SECONDS > room or self.growers:
            self.host.projected, self.credited = g.usage, 0
            return
        self.credited = g.draining_usage

    def _growers(self) -> list[WorkerRecord]:
        """Workers that grow by more than GROWER_BYTES within STOP_SECONDS, fastest first."""
        rates = self.rates
        if not rates:
            return []
        floor = min(self.c.ceiling * GROWTH_TOLERANCE, GROWER_BYTES) / STOP_SECONDS
        fast = [w for w in self.g.live if rates.get(w.worker, 0.0) > floor]
        return sorted(fast, key=lambda w: (-rates[w.worker], w.worker))

    def grower_first(self, emergency: bool) -> bool:
        """P6 at hard with a runaway grower: act on it before anything else.

        Whatever else is being stopped, and whatever the sizes: its requests
        are aborted (that also ends a fire drill standing in for one), an idle
        one is stopped (P6.2), a loading one's load is aborted (P6.4), a busy
        one is marked for unload in an emergency (P6.3). Pinned growers are
        left to step 5. True when it acted (P6's steps 3-6 then wait a tick).
        """
        acted = False
        out = self.out
        for w in self.growers:
            if w.pinned or w.worker in self.stopped or w.state == "draining":
                continue
            rate = format_size(int(self.rates[w.worker]))
            why = f"hard pressure and {w.model} grows {rate}/s"
            if w.state in _LOADING_STATES:
                out.append(AbortLoad(worker=w.worker, model=w.model, reason=f"{why}: abort its load"))
                acted = True
                continue
            out.append(AbortWorkerRequests(worker=w.worker, model=w.model, reason=(
                f"{why}: abort its requests now, whatever else is being stopped")))
            if is_idle(w):
                self._stop(w, f"{why}: stop it (idle, nothing to finish)")
            elif emergency:
                out.append(MarkForUnload(worker=w.worker, model=w.model, reason=(
                    f"memory emergency: unload {w.model} once its requests have ended")))
            acted = True
        return acted

    # -- P4 / P5 -------------------------------------------------------------------

    @property
    def pool_floor(self) -> int:
        """P4's threshold: `[guard] pool_max` (M1 gives MLX the same figure), else 2 GiB."""
        return self.s.guard.pool_max or POOL_RECLAIM_FLOOR

    def grace(self, level: PressureLevel, emergency: bool) -> bool:
        """P4: give fat allocator pools a chance to drain before anything destructive.

        Deferring eviction while a fat pool drains at the next step boundary is
        cheaper than killing a model; the budget (5 ticks an episode) keeps a
        pool that never drains from livelocking the guard.
        """
        if emergency or self.s.guard.pressure_reclaim_disabled:
            return False
        if self.prev.grace_ticks >= GRACE_TICKS_MAX:
            return False
        floor = self.pool_floor
        fat = [w for w in self.g.live if w.memory.mlx_pool > floor and w.state != "draining"]
        used = self.prev.grace_ticks + (0 if self.s.recheck else 1)
        for w in fat:
            self.out.append(ReclaimPool(worker=w.worker, model=w.model, reason=(
                f"{level} pressure: return the {format_size(w.memory.mlx_pool)} allocator pool "
                f"(grace {used}/{GRACE_TICKS_MAX}, nothing destroyed)")))
        return bool(fat)

    def shrink_hot_cache(self, pool: _Pool) -> None:
        """P5 at hard: shrink prompt caches by LRU toward soft, then reclaim.

        The freed cache blocks land in the allocator pool; without the reclaim
        that follows, the bytes never left the process and the old enforcer
        concluded "nothing to evict" and livelocked until restart.
        """
        need = pool.projected - pool.soft
        shrunk: set[str] = set()
        if need > 0:
            dropped = self.cache_dropped if pool is self.host else set()  # C12 asked already
            shrunk |= dropped
            for w in sorted((w for w in self.g.serving if w.memory.cache_releasable > 0
                             and w.worker not in dropped), key=lru_key):
                take = min(w.memory.cache_releasable, w.memory.cache_bytes, need)
                if take <= 0:
                    continue
                self.out.append(ShrinkHotCache(
                    worker=w.worker, model=w.model, target_bytes=w.memory.cache_bytes - take,
                    reason=f"hard {_pressure(pool)}: free {format_size(take)} of prompt cache"))
                need -= take
                pool.projected -= take
                shrunk.add(w.worker)
                if need <= 0:
                    break
        if self.s.guard.pressure_reclaim_disabled:
            return
        for w in self.g.live:
            if w.worker in shrunk or (w.memory.mlx_pool > self.pool_floor and w.state != "draining"):
                self.out.append(ReclaimPool(worker=w.worker, model=w.model,
                                        reason=f"hard {_pressure(pool)}: return freed memory to the OS"))

    # -- P6 ------------------------------------------------------------------------

    def _gone(self, w: WorkerRecord) -> None:
        """A stopped process gives back what it held in every pool."""
        self.stopped.add(w.worker)
        self.host.projected -= w.usage
        if self.device is not None:
            self.device.projected -= w.device_bytes

    def _stop(self, w: WorkerRecord, reason: str) -> None:
        self.out.append(Stop(worker=w.worker, model=w.model, reason=reason))
        self._gone(w)

    def stop_marked(self, level: PressureLevel) -> None:
        """P6 step 1 at any level: a marked worker that has drained goes now.

        A mark is a promise made in an emergency (P6.3); keeping the model
        because the pressure it caused has ended would leave it loaded for
        ever, since TTL skips marked workers and new requests avoid it.
        """
        if self.c.ceiling <= 0:
            return  # the guard is off: it destroys nothing (a new request replaces the worker)
        drained = (w for w in self.g.idle if w.marked_for_unload and not w.pinned)
        for w in sorted(drained, key=lru_key):
            when = f"{level} pressure" if level != "ok" else "after the pressure"
            self._stop(w, f"{when}: {w.model} was marked for unload in an emergency and has drained")

    def evict(self, pool: _Pool, level: PressureLevel, emergency: bool, stepped: bool = False) -> None:
        """P6: act, in order, while projected usage is above soft.

        Step 1 (marked and drained) has run already, at every level
        (`stop_marked`). Pinned models are never stopped or marked here; only
        step 5 touches them, and it aborts requests while keeping the model
        loaded. `stepped`: a runaway grower was acted on this tick
        (`grower_first`), which stands for this tick's step of 3-6.
        """
        soft = pool.soft
        if pool.projected <= soft:
            return
        stopped = self.stopped
        idle = sorted((w for w in self.g.idle if not w.pinned and not w.marked_for_unload
                       and w.worker not in stopped), key=lru_key)
        # every worker stopped so far this tick was serving and unpinned (P6.1, the grower, step 2)
        loaded_unpinned = self.g.unpinned - len(stopped)
        soft_words = ""
        for w in idle:  # step 2
            if pool.projected <= soft:
                return
            if level != "hard" and loaded_unpinned <= 1:
                return  # soft: keep the last non-pinned model; the pause is enough
            if pool.held(w) <= 0:
                continue  # D4: stopping it frees nothing in this pool
            if not soft_words:
                soft_words = format_size(soft)
            self._stop(w, (f"{level} {_pressure(pool)}: stop idle {w.model} (least recently used), "
                           f"{pool.usage_words} {format_size(pool.projected)} > soft {soft_words}"))
            loaded_unpinned -= 1
        if pool.projected <= soft or level != "hard" or stepped:
            return
        self._hard_steps(pool, emergency)

    def _hard_steps(self, pool: _Pool, emergency: bool) -> None:
        """P6 steps 3-6: at hard with no idle victim left; one step per tick."""
        out, stopped = self.out, self.stopped
        busy = [w for w in self.g.serving if not w.pinned and w.worker not in stopped
                and not is_idle(w) and pool.held(w) > 0]
        if busy:  # step 3
            w = min(busy, key=lru_key)
            out.append(AbortWorkerRequests(worker=w.worker, model=w.model, reason=(
                f"hard {_pressure(pool)}, no idle model to stop: abort requests of {w.model} "
                "(least recently used)" + ("" if emergency else ", keep it loaded"))))
            if emergency:
                out.append(MarkForUnload(worker=w.worker, model=w.model, reason=(
                    f"memory emergency: unload {w.model} once its requests have ended")))
            return
        if self.g.loading:  # step 4
            for w in self.g.loading:
                out.append(AbortLoad(worker=w.worker, model=w.model,
                                     reason=f"hard {_pressure(pool)}: abort loading {w.model}"))
            return
        if emergency and pool.projected >= pool.ceiling:  # step 5
            active = [w for w in self.g.serving if w.running or w.queued]
            for w in active:
                out.append(AbortWorkerRequests(worker=w.worker, model=w.model, reason=(
                    f"memory emergency: {pool.usage_words} {format_size(pool.projected)} >= ceiling "
                    f"{format_size(pool.ceiling)}; abort requests of {w.model}, keep it loaded")))
            if active:
                return
        # step 6; a worker P5 already asked to reclaim at its next step boundary needs no second ask
        asked = {x.worker for x in out if isinstance(x, ReclaimPool)}
        for w in self.g.serving:
            if w.worker not in asked:
                out.append(ReclaimPool(worker=w.worker, model=w.model, idle_only=True, reason=(
                    f"hard {_pressure(pool)}, nothing to evict: return the allocator pool when idle")))

    # -- P8 / P9 / P10 -------------------------------------------------------------

    def walk_concurrency(self, level: PressureLevel) -> None:
        """P8: one step per tick toward the configured maximum (ok) or 1 (pressure).

        One step at a time keeps a burst of finishing requests from refilling
        every slot the moment the level dips below soft.
        """
        if self.s.recheck:
            return
        ok = level == "ok"
        reason = ("ok: one step toward the configured maximum" if ok
                  else f"{level} pressure: one step toward 1")
        stopped, out = self.stopped, self.out
        for w in self.g.serving:
            cap = w.concurrency or w.max_concurrency
            target = w.max_concurrency if ok else 1
            if cap == target or w.worker in stopped:
                continue
            out.append(SetConcurrency(worker=w.worker, model=w.model, reason=reason,
                                      cap=cap + 1 if cap < target else cap - 1))

    def expire_ttl(self) -> None:
        """P10: unload idle models past their TTL; pinned models never expire."""
        now, default = self.s.now, self.s.guard.idle_timeout
        for w in self.g.serving:
            ttl = default if w.ttl is None else w.ttl
            if ttl <= 0 or now - w.last_access <= ttl:  # cheapest test first: most never expire
                continue
            if w.pinned or w.marked_for_unload or not is_idle(w) or w.worker in self.stopped:
                continue
            idle_for = now - w.last_access
            self.out.append(ExpireTTL(worker=w.worker, model=w.model, reason=(
                f"{w.model} idle for {idle_for:.0f} s, longer than its TTL of {ttl:g} s")))
            self._gone(w)

    def interval(self, level: PressureLevel) -> float:
        """P9: fast while anything can change the answer, slow when all is quiet."""
        s, g = self.s, self.s.guard
        hint = s.activity_hint
        hinted = hint is not None and s.now < hint + max(2.0, 2 * g.poll_interval)
        if level != "ok" or self.g.loading or self.g.active or self.g.unknown or hinted:
            return g.poll_interval
        quiet = g.loaded_idle_interval if self.g.serving else g.unloaded_idle_interval
        return min(quiet, self._until_expiry())

    def _until_expiry(self) -> float:
        """P10 at a slow cadence: wake for the next TTL expiry (a second at the finest), not 10 s late."""
        now, default, fine = self.s.now, self.s.guard.idle_timeout, self.s.guard.poll_interval
        soonest = float("inf")
        for w in self.g.serving:
            ttl = default if w.ttl is None else w.ttl
            if w.pinned or w.marked_for_unload or ttl <= 0 or w.worker in self.stopped:
                continue
            soonest = min(soonest, max(fine, ttl - (now - w.last_access) + 0.01))
        return soonest


def _hold_still(s: Snapshot, t: _Tick) -> TickResult:
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
                      usage=t.g.usage, projected_usage=t.projected, emergency=False,
                      next_interval=s.guard.poll_interval, draining_credited=t.credited)


def tick(s: Snapshot) -> TickResult:
    """Decide one tick. Pure: the same snapshot always gives the same result.

    Order of the decisions: warnings, level change, admission pause/resume,
    limits, P6.1 stops of drained marked workers (any level), P4 grace
    reclaim or P5/P6 pressure actions (host pool, then device pool: D4), P8
    concurrency steps, P10 TTL expiries.
    """
    t = _Tick(s)
    if s.host is None and s.state.last_total <= 0 and s.guard.enabled:
        return _hold_still(s, t)
    c, dc, prev = t.c, t.dc, s.state
    tier_warned, no_reading, reserve_warned = t.warnings()
    host_level, over, host_emergency = t.pressure()
    dev_usage = t.g.device_bytes
    dev_level = device_level(dev_usage, dc)
    dev_over, dev_emergency = device_emergency(dev_usage, dc, prev.device_over_ceiling_ticks, recheck=s.recheck)
    level = worse_level(host_level, dev_level)  # D4: the group's level is the worse pool's
    emergency = host_emergency or dev_emergency
    if level != prev.level:
        t.out.append(_level_changed(prev.level, level, t, host_level, dev_usage))
    paused = t.admission(level)
    common, limited, cache_kept, reduced = t.limits(paused, host_level)
    seen, seen_at, growth = t.growth()
    t.discount_draining(host_level, growth)
    t.host.projected -= t.cache_drop_bytes  # C12's cache drop, asked in t.limits
    t.stop_marked(level)
    grace = 0 if level == "ok" else prev.grace_ticks
    if level != "ok":
        # a runaway grower at hard is not given a grace tick: it would grow through it
        if not t.growers and t.grace(level, emergency):
            grace += 0 if s.recheck else 1
        else:
            pools = [(t.host, host_level, host_emergency)]
            if t.device is not None:
                pools.append((t.device, dev_level, dev_emergency))
            for pool, pool_level, pool_emergency in pools:
                if pool_level == "ok":
                    continue
                acting: PressureLevel = pool_level
                stepped = pool is t.host and t.grower_first(pool_emergency)
                if pool_level == "hard":
                    t.shrink_hot_cache(pool)
                    acting = pool.classify()
                t.evict(pool, acting, pool_emergency, stepped=stepped)
    t.walk_concurrency(level)
    t.expire_ttl()
    interval = t.interval(level)
    state = PolicyState(
        level=level, over_ceiling_ticks=over, grace_ticks=grace, admission_paused=paused,
        tier_warned=tier_warned, no_reading_warned=no_reading, reserve_warned=reserve_warned,
        last_total=t.total, interval=interval, limits=common, limited=limited, cache_kept=cache_kept, reduced=reduced,
        usage_seen=seen,
        seen_at=seen_at, growth=growth, device_over_ceiling_ticks=dev_over)
    return TickResult(state=state, decisions=t.out, ceilings=c, level=level, usage=t.g.usage,
                      projected_usage=t.projected, emergency=emergency, next_interval=interval,
                      draining_credited=t.credited, device=dc, device_usage=dev_usage,
                      device_level=dev_level, device_emergency=dev_emergency, host_level=host_level)


def _pressure(pool: _Pool) -> str:
    return "pressure" if pool.name == "host" else "device memory pressure"


def _level_changed(before: PressureLevel, level: PressureLevel, t: _Tick, host_level: PressureLevel, dev_usage: int) -> LevelChanged:
    """P1/D4: the figures of the pool that sets the group's level (the host on a tie)."""
    c, dc = t.c, t.dc
    if dc is None or level == host_level:
        return LevelChanged(from_level=before, to_level=level, usage=t.g.usage, soft=c.soft, hard=c.hard,
                            ceiling=c.ceiling, reason=_level_reason(level, t.g.usage, c))
    return LevelChanged(
        from_level=before, to_level=level, usage=dev_usage, soft=dc.soft, hard=dc.hard, ceiling=dc.ceiling,
        pool="device", reason=(
            f"device usage {format_size(dev_usage)} against soft {format_size(dc.soft)}, hard "
            f"{format_size(dc.hard)}, device ceiling {format_size(dc.ceiling)} ({dc.binding})"))


def _level_reason(level: PressureLevel, usage: int, c: Ceilings) -> str:
    if c.ceiling <= 0:
        return "the guard is off: no limit"
    return (f"usage {format_size(usage)} against soft {format_size(c.soft)}, hard "
            f"{format_size(c.hard)}, ceiling {format_size(c.ceiling)} ({c.binding})")
