"""The guarded group as one tick sees it: U2 usage, C2's `own` terms and the
worker buckets the rules choose from. Shared by the policy, admission and
status so all three count memory the same way.

Also P1 and P2 as pure arithmetic on one pool's figures, so host RAM and a
discrete device (D4) classify and count alike.

Public names (stable): WorkerGroup, ceilings_for, is_idle, lru_key, classify,
over_ceiling, EMERGENCY_MARGIN, EMERGENCY_TICKS.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Literal, get_args

from shared.sizes import GiB
from shared.states import LIVE_STATES, LOADING_STATES, SERVING_STATES, WorkerState
from shared.vocab import PressureLevel
from supervisor.policy.ceilings import Ceilings, compute_ceilings
from supervisor.policy.snapshot import Snapshot, WorkerRecord

Role = Literal["gone", "draining", "serves", "loads", "other"]
_GONE: Role = "gone"
_DRAINING: Role = "draining"
_SERVES: Role = "serves"
_LOADS: Role = "loads"


def _role(state: WorkerState) -> Role:
    """The part a worker in `state` plays in the group (shared.states' sets)."""
    if state not in LIVE_STATES:
        return _GONE  # stopped, dead: no process, no memory
    if state == "draining":
        return _DRAINING
    if state in SERVING_STATES:
        return _SERVES
    return _LOADS if state in LOADING_STATES else "other"


_ROLE: dict[WorkerState, Role] = {state: _role(state) for state in get_args(WorkerState)}
"""Every worker state's role, worked out once from shared.states' sets: the group pass
asks one dict per worker instead of up to three frozensets (a set's `in` costs about
160 instructions in CPython 3.11, a dict subscript about half of that)."""


class WorkerGroup:
    """One pass over the worker records.

    Only workers whose process exists count (stopped and dead ones
    hold no memory). `usage` is U2: supervisor footprint + each worker's U1
    usage; `own` is C2's group footprint; `draining_usage` is the part that a
    stop already under way will give back, and `draining_idle_usage` the part
    of it held by draining workers with nothing left to finish (`draining_idle`;
    they exit within a fraction of a second; one with a running request may
    take as long as the request does). `growing` says whether a worker that can grow
    fast is there: one loading or running a request (an idle worker holds
    still). `device_bytes` and `draining_device_bytes` are the same sums on a
    discrete device's pool (D1, D4; the supervisor holds nothing there).

    The same pass also gathers what the policy tick would otherwise walk the
    workers again for (one extra pass at a time, the tick had grown to 1.3x the
    instructions of the tick before the device pool): `idle` (serving workers with
    nothing running or queued, `is_idle`, neither pinned nor marked for unload:
    P6.2's victims, in snapshot order), `unpinned`
    (how many serving workers are not pinned), `pids` (worker -> pid of
    every live worker, T6's record of who holds which limits), `caps` (worker
    -> the concurrency cap it runs with, P8: what its limits must carry) and `usage_now`
    (worker -> usage of every live worker not draining, the growth estimate's
    sample). `spares`: the spare workers not draining, starting or waiting
    (SPEC W1: no model); they are neither serving nor loading. `marked`: the idle workers marked
    for unload (P6.1 stops them; most ticks there are none). `off_max` and
    `off_one`: whether some serving worker's cap is not its configured
    maximum, or not 1 -- whether P8 has a step to take at ok, or under
    pressure, told without a second walk of the workers.
    """

    __slots__ = ("usage", "own", "own_gpu", "hot_used", "draining_usage", "draining_idle_usage", "live",
                 "serving", "loading", "active", "unknown", "growing", "device_bytes",
                 "draining_device_bytes", "cached", "draining_count", "idle", "unpinned", "pids", "caps", "usage_now",
                 "spares", "marked", "draining_idle", "off_max", "off_one")

    def __init__(self, s: Snapshot) -> None:
        own_gpu = hot_used = draining = draining_idle = device = draining_device = n_draining = 0
        # the live workers' footprints, and U1 of those not draining (`usage_now`), summed once in C:
        # `sum` adds in a machine word, where `+=` in the loop made a new int per worker (past 2**30)
        footprints: list[int] = []
        serving: list[WorkerRecord] = []
        loading: list[WorkerRecord] = []
        cached: list[WorkerRecord] = []
        idle: list[WorkerRecord] = []
        spares: list[WorkerRecord] = []
        marked: list[WorkerRecord] = []
        idle_drainers: list[WorkerRecord] = []
        pids: dict[str, int] = {}
        caps: dict[str, int] = {}
        usage_now: dict[str, int] = {}
        active = unknown = busy = off_max = off_one = gone = False
        n_pinned = 0
        for w in s.workers:
            role = _ROLE[w.state]
            if role is _GONE:
                gone = True
                continue
            name, m = w.worker, w.memory
            pids[name] = w.pid
            caps[name] = cap = w.concurrency or w.max_concurrency
            footprints.append(m.footprint)
            if w.gpu_bytes or w.device_bytes:  # most machines: neither (no Metal GPU share, no device)
                own_gpu += w.gpu_bytes
                device += w.device_bytes
            if m.cache_bytes:
                hot_used += m.cache_bytes
                cached.append(w)
            if role is _SERVES and w.model:  # most workers: asked first, in one test
                usage_now[name] = m.usage
                serving.append(w)
                if cap != 1:
                    off_one = True
                if cap != w.max_concurrency:
                    off_max = True
                if w.pinned:
                    n_pinned += 1
                if w.running or w.queued:
                    active = busy = True
                elif w.state == "ready":
                    if w.marked_for_unload:
                        marked.append(w)
                    elif not w.pinned:
                        idle.append(w)
                continue
            u = m.usage
            if role is _DRAINING:
                n_draining += 1
                draining += u
                draining_device += w.device_bytes
                if not (w.running or w.queued):
                    draining_idle += u
                    idle_drainers.append(w)
                active = True
                continue
            usage_now[name] = u
            if not w.model:  # W1: a spare, starting or waiting; not a load, not serving
                spares.append(w)
            elif role is _LOADS:
                loading.append(w)
            else:  # wedged: no trustworthy activity reading
                unknown = True
        # most ticks no record is of a gone process: the snapshot's own list is the live one (no one
        # changes it), else a copy without the gone
        self.live = [w for w in s.workers if _ROLE[w.state] is not _GONE] if gone else s.workers
        sup = s.supervisor_footprint
        self.usage = sup + draining + sum(usage_now.values())
        self.own, self.own_gpu, self.hot_used = sup + sum(footprints), own_gpu, hot_used
        self.draining_usage, self.draining_idle_usage = draining, draining_idle
        self.serving, self.loading, self.cached = serving, loading, cached
        self.active, self.unknown = active, unknown
        self.device_bytes, self.draining_device_bytes = device, draining_device
        self.draining_count = n_draining
        self.idle, self.unpinned, self.pids, self.caps, self.usage_now = idle, len(serving) - n_pinned, pids, caps, usage_now
        self.spares, self.marked, self.draining_idle = spares, marked, idle_drainers
        self.off_max, self.off_one = off_max, off_one
        self.growing = bool(loading) or busy


def snapshot_total(s: Snapshot) -> int:
    """The machine's size: this tick's reading, else the last one (host is None)."""
    return s.host.total if s.host is not None else s.state.last_total


def ceilings_for(s: Snapshot, group: WorkerGroup | None = None) -> Ceilings:
    """C1-C12 for this snapshot."""
    g = group if group is not None else WorkerGroup(s)
    guard = s.guard
    return compute_ceilings(
        tier=guard.tier, enabled=guard.enabled, total=snapshot_total(s), host=s.host, own=g.own,
        own_gpu=g.own_gpu, gpu_cap_raw=s.gpu_cap_raw, custom_ceiling=guard.custom_ceiling,
        soft_threshold=guard.soft_threshold, hard_threshold=guard.hard_threshold,
        hot_cache_max=guard.hot_cache_max, hot_cache_used=g.hot_used, stranded=s.wired_stranded,
    )


def is_idle(w: WorkerRecord) -> bool:
    """Loaded, nothing running or queued: stopping it costs no work in progress."""
    return w.state == "ready" and not w.running and not w.queued


lru_key: Callable[[WorkerRecord], tuple[float, str]] = attrgetter("last_access", "worker")
"""Least recently used first; the worker id breaks ties so order is deterministic.

(`w -> (w.last_access, w.worker)`, as an attrgetter: a sort by it calls no
Python function per worker.)
"""


EMERGENCY_MARGIN = 2 * GiB       # P2: this far over the ceiling is an emergency at once
EMERGENCY_TICKS = 2              # P2: ... or this many consecutive ticks at or over it


def classify(usage: int, ceiling: int, soft: int, hard: int) -> PressureLevel:
    """P1 on one pool: ok below soft, soft below hard, else hard (ceiling 0: the guard is off, ok)."""
    if ceiling <= 0 or usage < soft:
        return "ok"
    return "soft" if usage < hard else "hard"


def over_ceiling(usage: int, ceiling: int, count: int, recheck: bool) -> tuple[int, bool]:
    """P2 on one pool: (the over-ceiling count to carry, emergency).

    Below the ceiling (or the guard off) the count resets. At or over it the
    count goes up by one, except on a recheck (P7: the re-evaluation right
    after acting is not a new tick; it may reset the count, never advance it).
    Emergency at ceiling + EMERGENCY_MARGIN, or when the count reaches EMERGENCY_TICKS.
    """
    if ceiling <= 0 or usage < ceiling:
        return 0, False
    over = count + (0 if recheck else 1)
    return over, usage >= ceiling + EMERGENCY_MARGIN or over >= EMERGENCY_TICKS
