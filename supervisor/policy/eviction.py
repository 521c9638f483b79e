"""P4-P6: what the guard does about memory pressure, on the pool that is under it.

P4 gives fat allocator pools a grace tick to drain; P5 shrinks prompt caches
at hard; P6 stops idle models by LRU toward soft, and at hard with none left
aborts requests, aborts loads, and in an emergency marks models for unload,
one step a tick. A runaway grower is acted on first. Stops under way are
credited as gone only when they can land before the ceiling (see the
projection in pressure.py's docstring).
"""

from __future__ import annotations

from shared.sizes import GiB, MiB
from shared.states import LOADING_STATES
from shared.vocab import PressureLevel
from supervisor.policy.decisions import (
    AbortLoad,
    AbortWorkerRequests,
    MarkForUnload,
    ReclaimPool,
    ShrinkHotCache,
    size_text,
)
from supervisor.policy.group import is_idle, lru_key
from supervisor.policy.snapshot import WorkerRecord
from supervisor.policy.tickstate import MemoryPool, Tick

POOL_RECLAIM_FLOOR = 2 * GiB     # P4 default ([guard] pool_max): a smaller pool is not worth a clear
GRACE_TICKS_MAX = 5              # P4: at 1 s a tick, covers one ~5 s prefill chunk
STOP_SECONDS = 0.3               # P6 at hard: how long a stop under way takes (measured 0.13 s idle)
GROWTH_WINDOW = 0.05             # shortest span a growth estimate is taken over (sample jitter)
GROWTH_TOLERANCE = 0.01          # of the ceiling: growth during a stop below this is jitter, not a runaway
GROWER_BYTES = 64 * MiB          # ... and at most this much: on a large ceiling 1 % is a lot of growth


def measure_growth(t: Tick) -> tuple[dict[str, int], float, float]:
    """(usage_seen, seen_at, bytes/s): how fast the non-draining workers grow.

    The rate is taken against a baseline at least GROWTH_WINDOW old when
    there is one: a tick sooner than that (a P7 recheck, a burst of
    watermark wake-ups) measures from the older baseline and keeps it.
    The span is floored at GROWTH_WINDOW, so sample jitter over a few ms
    is never read as a fast rate -- but a real burst is measured at
    once. (Keeping the previous estimate instead let a 1 GiB/s
    grower that crossed soft and hard within 50 ms ride on the rate
    measured before it started, and the stop under way was credited.)
    Sets `t.rates`: each non-draining worker's own rate (grower_first).
    """
    prev, now = t.prev, t.s.now
    current = t.group.usage_now
    seen, span = prev.usage_seen, now - prev.seen_at
    if not seen or span < 0:
        return current, now, 0.0
    per = span if span > GROWTH_WINDOW else GROWTH_WINDOW
    rates = {} if current == seen else {  # nothing moved (a quiet tick): no rate to work out
        k: (u - seen[k]) / per for k, u in current.items() if k in seen and u > seen[k]}
    t.rates = rates
    grew = sum(rates.values())
    if span < GROWTH_WINDOW:
        return seen, prev.seen_at, grew
    return current, now, grew


def discount_draining(t: Tick, level: PressureLevel, growth: float) -> None:
    """At hard, stops under way count as done only when they land before the ceiling.

    (Without a stop under way, P4-P6 apply as written.) They do not when the group grows fast enough to pass the ceiling
    (further, if it is over) within STOP_SECONDS by more than a 1 %
    tolerance, nor when any worker is a runaway grower (`_growers`):
    how long a stop takes depends on the size of what is stopped and on
    the machine, so no guess of it may let a grower run on.
    Without growth, stopping more models would not bring the memory back sooner.
    """
    c, group = t.c, t.group
    if level != "hard" or not group.draining_usage:
        t.credited = group.draining_usage
        return
    t.growers = _growers(t)
    room = max(0, c.ceiling - group.usage) + c.ceiling * GROWTH_TOLERANCE
    if growth * STOP_SECONDS > room or t.growers:
        t.host.projected, t.credited = group.usage, 0
        return
    t.credited = group.draining_usage


def _growers(t: Tick) -> list[WorkerRecord]:
    """Workers that grow by more than GROWER_BYTES within STOP_SECONDS, fastest first."""
    rates = t.rates
    if not rates:
        return []
    floor = min(t.c.ceiling * GROWTH_TOLERANCE, GROWER_BYTES) / STOP_SECONDS
    fast = [w for w in t.group.live if rates.get(w.worker, 0.0) > floor]
    return sorted(fast, key=lambda w: (-rates[w.worker], w.worker))


def grower_first(t: Tick, emergency: bool) -> bool:
    """P6 at hard with a runaway grower: act on it before anything else.

    Whatever else is being stopped, and whatever the sizes: its requests
    are aborted (that also ends a fire drill standing in for one), an idle
    one is stopped (P6.2), a loading one's load is aborted (P6.4), a busy
    one is marked for unload in an emergency (P6.3). Pinned growers are
    left to step 5. True when it acted (P6's steps 3-6 then wait a tick).
    """
    acted = False
    out = t.out
    for w in t.growers:
        if w.pinned or w.worker in t.stopped or w.state == "draining":
            continue
        rate = size_text(int(t.rates[w.worker]))
        why = f"hard pressure and {w.model} grows {rate}/s"
        if w.state in LOADING_STATES:
            out.append(AbortLoad(worker=w.worker, model=w.model, reason=f"{why}: abort its load"))
            acted = True
            continue
        out.append(AbortWorkerRequests(worker=w.worker, model=w.model, reason=(
            f"{why}: abort its requests now, whatever else is being stopped")))
        if is_idle(w):
            t.stop(w, f"{why}: stop it (idle, nothing to finish)")
        elif emergency:
            out.append(MarkForUnload(worker=w.worker, model=w.model, reason=(
                f"memory emergency: unload {w.model} once its requests have ended")))
        acted = True
    return acted


def pool_floor(t: Tick) -> int:
    """P4's threshold: `[guard] pool_max` (M1 gives MLX the same figure), else 2 GiB."""
    return t.s.guard.pool_max or POOL_RECLAIM_FLOOR


def reclaim_grace(t: Tick, level: PressureLevel, emergency: bool) -> bool:
    """P4: give fat allocator pools a chance to drain before anything destructive.

    Deferring eviction while a fat pool drains at the next step boundary is
    cheaper than killing a model; the budget (5 ticks an episode) keeps a
    pool that never drains from livelocking the guard.
    """
    if emergency or t.s.guard.pressure_reclaim_disabled:
        return False
    if t.prev.grace_ticks >= GRACE_TICKS_MAX:
        return False
    floor = pool_floor(t)
    fat = [w for w in t.group.live if w.memory.mlx_pool > floor and w.state != "draining"]
    used = t.prev.grace_ticks + (0 if t.s.recheck else 1)
    for w in fat:
        t.out.append(ReclaimPool(worker=w.worker, model=w.model, reason=(
            f"{level} pressure: return the {size_text(w.memory.mlx_pool)} allocator pool "
            f"(grace {used}/{GRACE_TICKS_MAX}, nothing destroyed)")))
    return bool(fat)


def shrink_hot_cache(t: Tick, pool: MemoryPool) -> None:
    """P5 at hard: shrink prompt caches by LRU toward soft, then reclaim.

    The freed cache blocks land in the allocator pool; without the reclaim
    that follows, the bytes never left the process and the old enforcer
    concluded "nothing to evict" and livelocked until restart.
    """
    need = pool.projected - pool.soft
    shrunk: set[str] = set()
    if need > 0:
        dropped = t.cache_dropped if pool is t.host else set()  # C12 asked already
        shrunk |= dropped
        for w in sorted((w for w in t.group.serving if w.memory.cache_releasable > 0
                         and w.worker not in dropped), key=lru_key):
            take = min(w.memory.cache_releasable, w.memory.cache_bytes, need)
            if take <= 0:
                continue
            t.out.append(ShrinkHotCache(
                worker=w.worker, model=w.model, target_bytes=w.memory.cache_bytes - take,
                reason=f"hard {pool.pressure_words}: free {size_text(take)} of prompt cache"))
            need -= take
            pool.projected -= take
            shrunk.add(w.worker)
            if need <= 0:
                break
    if t.s.guard.pressure_reclaim_disabled:
        return
    floor = pool_floor(t)
    for w in t.group.live:
        if w.worker in shrunk or (w.memory.mlx_pool > floor and w.state != "draining"):
            t.out.append(ReclaimPool(worker=w.worker, model=w.model,
                                    reason=f"hard {pool.pressure_words}: return freed memory to the OS"))


def stop_marked(t: Tick, level: PressureLevel) -> None:
    """P6 step 1 at any level: a marked worker that has drained goes now.

    A mark is a promise made in an emergency (P6.3); keeping the model
    because the pressure it caused has ended would leave it loaded for
    ever, since TTL skips marked workers and new requests avoid it.
    """
    if not t.group.marked or t.c.ceiling <= 0:
        return  # none marked (most ticks), or the guard is off: it destroys nothing
    drained = [w for w in t.group.marked if not w.pinned]  # idle and marked
    for w in sorted(drained, key=lru_key):
        when = f"{level} pressure" if level != "ok" else "after the pressure"
        t.stop(w, f"{when}: {w.model} was marked for unload in an emergency and has drained")


def evict(t: Tick, pool: MemoryPool, level: PressureLevel, emergency: bool, stepped: bool = False) -> None:
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
    stopped = t.stopped
    idle = t.group.idle  # idle, neither pinned nor marked
    idle = sorted([w for w in idle if w.worker not in stopped] if stopped else idle, key=lru_key)
    # every serving worker stopped so far this tick was unpinned (P6.1, the grower, step 2); spares serve none
    loaded_unpinned = t.group.unpinned - (sum(1 for w in t.group.serving if w.worker in stopped) if stopped else 0)
    soft_words = ""
    for w in idle:  # step 2
        if pool.projected <= soft:
            return
        if level != "hard" and loaded_unpinned <= 1:
            return  # soft: keep the last non-pinned model; the pause is enough
        if pool.held(w) <= 0:
            continue  # D4: stopping it frees nothing in this pool
        if not soft_words:
            soft_words = size_text(soft)
        t.stop(w, (f"{level} {pool.pressure_words}: stop idle {w.model} (least recently used), "
                       f"{pool.usage_words} {size_text(pool.projected)} > soft {soft_words}"))
        loaded_unpinned -= 1
    if pool.projected <= soft or level != "hard" or stepped:
        return
    _hard_steps(t, pool, emergency)


def _hard_steps(t: Tick, pool: MemoryPool, emergency: bool) -> None:
    """P6 steps 3-6: at hard with no idle victim left; one step per tick."""
    out, stopped = t.out, t.stopped
    busy = [w for w in t.group.serving if not w.pinned and w.worker not in stopped
            and not is_idle(w) and pool.held(w) > 0]
    if busy:  # step 3
        w = min(busy, key=lru_key)
        out.append(AbortWorkerRequests(worker=w.worker, model=w.model, reason=(
            f"hard {pool.pressure_words}, no idle model to stop: abort requests of {w.model} "
            "(least recently used)" + ("" if emergency else ", keep it loaded"))))
        if emergency:
            out.append(MarkForUnload(worker=w.worker, model=w.model, reason=(
                f"memory emergency: unload {w.model} once its requests have ended")))
        return
    if t.group.loading:  # step 4
        for w in t.group.loading:
            out.append(AbortLoad(worker=w.worker, model=w.model,
                                 reason=f"hard {pool.pressure_words}: abort loading {w.model}"))
        return
    if emergency and pool.projected >= pool.ceiling:  # step 5
        active = [w for w in t.group.serving if w.running or w.queued]
        for w in active:
            out.append(AbortWorkerRequests(worker=w.worker, model=w.model, reason=(
                f"memory emergency: {pool.usage_words} {size_text(pool.projected)} >= ceiling "
                f"{size_text(pool.ceiling)}; abort requests of {w.model}, keep it loaded")))
        if active:
            return
    # step 6; a worker P5 already asked to reclaim at its next step boundary needs no second ask
    asked = {x.worker for x in out if isinstance(x, ReclaimPool)}
    for w in t.group.serving:
        if w.worker not in asked:
            out.append(ReclaimPool(worker=w.worker, model=w.model, idle_only=True, reason=(
                f"hard {pool.pressure_words}, nothing to evict: return the allocator pool when idle")))
