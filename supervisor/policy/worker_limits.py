"""The limits each worker is handed (T6), less the other workers' prompt caches (C12).

Every tick works out the common limits from the ceilings and the level;
a worker is sent its own (an `ApplyLimits` entry of the tick's one
`HandOutLimits`, decisions.py) only when something it is told
changed: the common limits, its process (a respawn), its request slots (a
spare that took a model, a reload that lowered them), or the other workers'
cache bytes, which its limits subtract (C12). When the caches leave no room
under the ceiling for the next step they give way first (H3). On a discrete
device the workers also get the device watermarks in their own measure (D4).

What a decision carries is complete: every field the worker is told,
its concurrency cap (P8) included, so the enforcer only sends it. The caps
each worker's limits carry are kept from tick to tick (`PolicyState.caps`),
so a cap that changed outside the policy is handed out again.

P8's step is decided here too, before eviction, so a worker is told once a
tick: a step comes as a `SetConcurrency` entry with the whole limits, never beside
an `ApplyLimits` entry for the same worker. A worker stopped later in the same tick
(P5, P6) may so have been sent its step first; the stop follows it in the
decision list and the step is then moot. A serving worker's cap moves one
step a tick toward its configured maximum (ok) or 1 (pressure): one step
keeps a burst of finishing requests from refilling every slot the moment
the level dips below soft. A recheck (P7) is not a new tick: no step. The
step is worked out in the hand-out loop itself (a separate walk of the
serving workers cost 5 % of a tick at 64 workers).
"""

from __future__ import annotations

import msgspec

from shared.limits import Limits
from shared.sizes import MiB
from shared.states import SERVING_STATES
from shared.vocab import PressureLevel
from supervisor.policy.ceilings import limits_for, worker_limit
from supervisor.policy.decisions import HandOutLimits, LimitsEntry, ShrinkHotCache, size_text
from supervisor.policy.device import DeviceCeilings
from supervisor.policy.group import lru_key
from supervisor.policy.tickstate import Tick

DEVICE_OVERHEAD_STEP = 256 * MiB  # D4: the device watermarks handed to workers move in these steps


def limits_to_hand_out(
    t: Tick, paused: bool, level: PressureLevel, host_level: PressureLevel
) -> tuple[Limits, dict[str, int], int, dict[str, int]]:
    """Hand every worker the limits it does not have yet (T6: next tick at the latest), and
    P8's step of its concurrency cap, one entry per worker in the tick's one `HandOutLimits`.

    The common limits (nothing subtracted) and the caches' total are
    compared with the last ones handed out; a worker also gets its limits
    when it is new, its pid changed (a respawn), its cap is not the one its
    limits carry, or the other workers' cache bytes (the total less its own)
    changed: its limits subtract them (C12). A worker whose cap takes a step
    this tick gets its whole limits with the new cap (a `SetConcurrency` entry),
    the others that need theirs an `ApplyLimits` entry, all in one `HandOutLimits`. Returns (common, worker ->
    pid, caches' total, worker -> own cache bytes) for the next tick; `t.caps`
    is then each worker's cap as handed out.

    When none of those changed (the common case: a quiet tick), no worker
    needs anything, and that is told by comparing the records whole
    rather than worker by worker.
    """
    prev, group = t.prev, t.group
    live = group.live
    common = _common_limits(t, paused)
    had, had_own, had_caps = prev.limited, prev.reduced, prev.caps
    total, own = _cache_reductions(t, host_level)
    ok = level == "ok"
    # P8: a step to take somewhere (a recheck, P7, is not a new tick: no step); the group pass told which way
    stepping = not t.s.recheck and (group.off_max if ok else group.off_one)
    pids, caps, before = group.pids, group.caps, prev.cache_kept
    changed = common != prev.limits
    if not stepping:
        if not changed and pids == had and total == before and own == had_own and caps == had_caps:
            return common, had, total, had_own
    else:  # the group pass's dict is this tick's own and nothing reads it after this (t.caps is it): stepped in place
        stepped_caps = caps
    common_why = "first limits" if prev.limits is None else "limits changed"
    stepped = "ok: one step toward the configured maximum" if ok else f"{level} pressure: one step toward 1"
    # the limits built so far: by cap for a worker that keeps no cache (most), else by (cap, own bytes)
    plain: dict[int, Limits] = {}
    built: dict[tuple[int, int], Limits] = {}
    entries: list[LimitsEntry] = []  # one HandOutLimits for them all (decisions.py says why)
    last_cap, last_limits = 0, common  # the cap of the last plain worker stepped, and its limits
    for w in live:
        worker = w.worker
        cap = w.concurrency or w.max_concurrency  # = caps[worker] (the group pass), without a dict lookup
        if stepping and w.state in SERVING_STATES and w.model:  # P8 (module doc): serving workers step
            target = w.max_concurrency if ok else 1
            if cap != target:
                cap = stepped_caps[worker] = cap + 1 if cap < target else cap - 1
                if cap == last_cap and worker not in own:  # most: no cache, the cap of the worker before
                    limits = last_limits
                else:
                    limits = _limits_of(common, cap, total, own.get(worker, 0), plain, built)
                    if worker not in own:
                        last_cap, last_limits = cap, limits
                entries.append((worker, w.model, limits, stepped, True))
                continue
        if changed:
            why = common_why
        elif had.get(worker) != w.pid:
            why = "new worker"
        elif had_caps.get(worker) != cap:
            why = "its request slots changed"
        elif total - own.get(worker, 0) != before - had_own.get(worker, 0):
            why = "other workers' prompt caches changed"
        else:
            continue
        met = None if worker in own else plain.get(cap)  # most: no cache, a cap met already
        if met is None:
            met = _limits_of(common, cap, total, own.get(worker, 0), plain, built)
        entries.append((worker, w.model, met, why, False))
    if entries:
        t.out.append(HandOutLimits(entries=entries))
    elif len(had) == len(live) and total == before and own == had_own:
        return common, had, total, had_own
    return common, pids, total, own


def _common_limits(t: Tick, paused: bool) -> Limits:
    """The limits every worker is told, before its own cap and the others' caches (C12)."""
    guard, c = t.s.guard, t.c
    # H2: an equal share of the budget in force per worker that keeps a cache
    # (a draining worker is on its way out), recomputed as they come and go
    keepers = len(t.group.live) - t.group.draining_count
    cache_cap = c.hot_cache_budget // keepers if c.hot_cache_budget > 0 and keepers else 0
    common = limits_for(c, admission_paused=paused, safe_zone_ratio=guard.safe_zone_ratio,
                        min_chunk_tokens=guard.min_chunk_tokens, cache_cap=cache_cap,
                        pool_max=guard.pool_max, others_cache=0, wire_weights=guard.wire_weights)
    if t.dc is not None and t.dc.ceiling > 0:  # D4: workers report device crossings at once
        common = _device_watermarks(t, common, t.dc)
    return common


def _limits_of(common: Limits, cap: int, total: int, mine: int,
               plain: dict[int, Limits], built: dict[tuple[int, int], Limits]) -> Limits:
    """The limits of a worker that keeps `mine` cache bytes, or of a cap not met yet this tick,
    built once a tick for each (cap, own bytes) and kept for the workers that share them."""
    if not mine:
        limits = plain.get(cap)
        if limits is None:
            limits = plain[cap] = worker_limits(common, cap, total)
        return limits
    limits = built.get((cap, mine))
    if limits is None:
        limits = built[(cap, mine)] = worker_limits(common, cap, total - mine)
    return limits


def worker_limits(common: Limits, cap: int, others: int) -> Limits:
    """One worker's limits: the common ones, its concurrency cap, less `others` (C12)."""
    if not others:
        return msgspec.structs.replace(common, max_concurrency=cap)
    return msgspec.structs.replace(common, max_concurrency=cap,
                                   hard_limit=worker_limit(common.hard_limit, others),
                                   abort_limit=worker_limit(common.abort_limit, others))


def _cache_reductions(t: Tick, level: PressureLevel) -> tuple[int, dict[str, int]]:
    """C12: (the caches' bytes, each worker's own): its limits subtract the difference.

    When the caches leave no room under the ceiling for the group's next
    step (ceiling - every cache <= usage), they give way (H3): at hard P5
    shrinks them this tick; below hard the least recently used entries no
    request uses are dropped now (`ShrinkHotCache`; the worker then
    reports at once) until there is room. What is asked to go is not
    subtracted, and a limit is never brought down to a meaningless value
    (`worker_limit`).
    """
    c, group = t.c, t.group
    used = group.hot_used
    if used <= 0 or c.ceiling <= 0:
        return 0, {}
    own = {w.worker: w.memory.cache_bytes for w in group.cached}
    if c.ceiling - used <= group.usage:
        _give_way(t, own, level)
        used = sum(own.values())
    return used, own


def _give_way(t: Tick, keeps: dict[str, int], level: PressureLevel) -> None:
    """H3 for C12: lower `keeps` to the cache bytes each worker keeps once the caches make room."""
    group = t.group
    movable = [w for w in group.cached if w.memory.cache_releasable > 0 and w.state != "draining"]
    if level == "hard":  # P5 shrinks toward soft this tick (H3)
        for w in movable:
            keep, free = keeps[w.worker], w.memory.cache_releasable
            keeps[w.worker] = keep - free if free < keep else 0
        return
    # dropping x bytes lowers usage and the caches alike: room once x > (caches + usage - ceiling) / 2
    need = (sum(keeps.values()) + group.usage - t.c.ceiling) // 2 + 1
    why = ""
    for w in sorted(movable, key=lru_key):
        take = w.memory.cache_releasable  # min(releasable, kept, need), without the builtin's 1k instructions
        take = keeps[w.worker] if keeps[w.worker] < take else take
        take = need if need < take else take
        if take <= 0:
            continue
        keeps[w.worker] -= take
        why = why or (f"the prompt caches ({size_text(group.hot_used)}) leave no room under the ceiling "
                      f"({size_text(t.c.ceiling)}) for the next step")
        t.out.append(ShrinkHotCache(
            worker=w.worker, model=w.model, target_bytes=keeps[w.worker],
            reason=f"{why}: drop {size_text(take)}"))
        t.cache_dropped.add(w.worker)
        t.cache_drop_bytes += take
        need -= take
        if need <= 0:
            return


def _device_watermarks(t: Tick, common: Limits, dc: DeviceCeilings) -> Limits:
    """The device pool's watermarks in the workers' own measure (D1's fallback).

    A worker can only sum MLX active + pool from the ledger; NVML also
    counts each process's CUDA context (about half a GiB), which MLX does
    not see. The watermarks go out lowered by that overhead, so a worker's
    report comes at the crossing the enforcer will see, not half a GiB
    late. Rounded down to DEVICE_OVERHEAD_STEP so the limits (and a
    ApplyLimits to every worker) do not change with every tick's jitter.
    """
    mlx = sum(w.memory.mlx_active + w.memory.mlx_pool for w in t.group.live if w.device_bytes)
    overhead = max(0, t.group.device_bytes - mlx) // DEVICE_OVERHEAD_STEP * DEVICE_OVERHEAD_STEP
    return msgspec.structs.replace(common, device_soft=max(1, dc.soft - overhead),
                                   device_hard=max(1, dc.hard - overhead))
