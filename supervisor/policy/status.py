"""The guard's status (SPEC S1), built from a snapshot and its tick result.

`GuardStatus` is what `GET /status`, `python -m supervisor status` and the
`status` topic show. It is derived, never stored: the enforcer builds it from
the last snapshot and TickResult whenever someone asks.

With a discrete device (SPEC D) the status holds its pool beside the host's:
`GuardStatus.device` (a `shared.protocol.DevicePool`, None without a device)
and each worker's `device_bytes`. `device_pool` builds that struct from a tick
result; the enforcer publishes the same struct on the ceiling and pressure
topics (D6), so every surface shows one set of figures.

Public names (stable): GuardStatus, WorkerStatus, build_status, device_pool; DiskCacheStatus
(the prompt cache's disk tier, in `ServerStatus`).
"""

from __future__ import annotations

import msgspec

from shared.protocol import DevicePool, DiskCacheCounters, GuardEvent
from shared.states import LIVE_STATES
from shared.vocab import HostBinding, LoadPhase, PressureLevel, Tier
from supervisor.policy.ceilings import remedy, reserve_message, wired_limit_advice
from supervisor.policy.device import device_remedy
from supervisor.policy.pressure import TickResult
from supervisor.policy.snapshot import Snapshot


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """S1, per worker. `idle_seconds` is now - last_access (monotonic times mean
    nothing to a person)."""

    worker: str
    model: str
    pid: int
    state: str
    pinned: bool
    last_access: float
    idle_seconds: float
    usage: int
    mlx_active: int
    mlx_pool: int
    footprint: int
    running: int
    queued: int
    concurrency: int
    max_concurrency: int
    restarts: int
    marked_for_unload: bool
    cache_bytes: int = 0        # H2: the worker's prompt cache (measured)
    cache_releasable: int = 0   # H3: the part no request uses
    device_bytes: int = 0       # D1: held on the discrete device (0 without one)
    batch_bytes: int = 0        # the decode batch's KV buffers as allocated ...
    batch_live_bytes: int = 0   # ... of which its live rows' own tokens
    batch_relayouts: int = 0    # whole-batch copies (growth, compaction) since the worker started
    pool_returns: int = 0       # M1: the worker returned its pool itself, over the cap (CUDA)
    pool_returned: int = 0      # ... bytes those returns gave back


class GuardStatus(msgspec.Struct, frozen=True, kw_only=True):
    """S1: every figure the guard decides with, and why the ceiling is what it is."""

    enabled: bool
    tier: Tier
    custom_ceiling: int
    ceiling: int
    binding: HostBinding
    remedy: str
    static: int
    dynamic: int
    gpu_cap: int
    gpu_cap_raw: int
    reserve: int
    reserve_exceeds_total: bool
    warning: str               # C1/C2 words when the guard runs on a fallback
    total: int
    other_app_ratio: float
    hot_cache_reserved: int    # C12: the bytes the caches hold now, off the other workers' limits
    hot_cache_used: int        # H2: the group's prompt caches together (measured) ...
    hot_cache_max: int         # ... against this budget ([guard] hot_cache_max) ...
    hot_cache_budget: int      # ... bounded by a quarter of soft: the budget in force (H2)
    worker_ceiling: int
    worker_abort_limit: int
    abort_limit: int
    admission_ceiling: int
    residency_ceiling: int
    soft_threshold: float
    hard_threshold: float
    soft_bytes: int
    hard_bytes: int
    usage: int
    pressure_level: PressureLevel
    emergency: bool
    admission_paused: bool
    utilization: float         # usage / ceiling, 0 when there is no ceiling
    poll_interval: float
    workers: list[WorkerStatus]
    # D6: the discrete device's pool beside the host's (None: no device). The
    # figures above are the host pool's; `pressure_level` and `emergency` are
    # the group's, the worse of the two pools (D4).
    device: DevicePool | None = None
    custom_device_ceiling: int = 0   # D2: [guard] custom_device_ceiling (0 = unset)
    # M2 (macOS): [guard] wire_weights, and with it the C13 line when the kernel's cap is below the suggestion
    wire_weights: bool = False
    wired_advice: str = ""
    wired_stranded: int = 0          # M3: wired memory worker exits left behind, off static and the GPU cap


def _warning(snapshot: Snapshot, result: TickResult) -> str:
    c = result.ceilings
    if c.reserve_exceeds_total:
        return reserve_message(c)
    if c.enabled and c.tier != "custom" and c.reading == "none":
        return "no memory reading from this machine: the dynamic ceiling is the static one"
    return ""


def device_pool(result: TickResult, name: str = "") -> DevicePool | None:
    """D6: the device pool's figures of one tick (None when there is no device).

    `name` is the device's name where the caller knows it (NVML, or the
    worker's `mx.device_info()`); the tick does not carry it.
    """
    dc = result.device
    if dc is None:
        return None
    usage = result.device_usage
    return DevicePool(
        name=name, total=dc.total, free=dc.free if dc.free_known else None, usage=usage,
        others=dc.others, reserve=dc.reserve, reserve_exceeds_total=dc.reserve_exceeds_total,
        static=dc.static, dynamic=dc.dynamic, ceiling=dc.ceiling, binding=dc.binding,
        remedy=device_remedy(dc.binding, dc.tier), soft_threshold=dc.soft_threshold,
        hard_threshold=dc.hard_threshold, soft_bytes=dc.soft, hard_bytes=dc.hard,
        level=result.device_level, emergency=result.device_emergency,
        utilization=usage / dc.ceiling if dc.ceiling > 0 else 0.0,
    )


def build_status(snapshot: Snapshot, result: TickResult, device_name: str = "") -> GuardStatus:
    """S1 from the snapshot a tick saw and what it decided (D6: with its device pool)."""
    c, now = result.ceilings, snapshot.now
    workers = [
        WorkerStatus(
            worker=w.worker, model=w.model, pid=w.pid, state=w.state, pinned=w.pinned,
            last_access=w.last_access, idle_seconds=max(0.0, now - w.last_access),
            usage=w.usage, mlx_active=w.memory.mlx_active, mlx_pool=w.memory.mlx_pool,
            footprint=w.memory.footprint, running=w.running, queued=w.queued,
            concurrency=w.concurrency if w.concurrency > 0 else w.max_concurrency,
            max_concurrency=w.max_concurrency, restarts=w.restarts,
            marked_for_unload=w.marked_for_unload,
            cache_bytes=w.memory.cache_bytes, cache_releasable=w.memory.cache_releasable,
            device_bytes=w.device_bytes, batch_bytes=w.memory.batch_bytes,
            batch_live_bytes=w.memory.batch_live_bytes, batch_relayouts=w.memory.batch_relayouts,
            pool_returns=w.memory.pool_returns, pool_returned=w.memory.pool_returned,
        )
        for w in snapshot.workers
    ]
    return GuardStatus(
        enabled=c.enabled, tier=c.tier, custom_ceiling=snapshot.guard.custom_ceiling,
        ceiling=c.ceiling, binding=c.binding, remedy=remedy(c.binding, c.tier), static=c.static,
        dynamic=c.dynamic, gpu_cap=c.gpu_cap, gpu_cap_raw=c.gpu_cap_raw, reserve=c.reserve,
        reserve_exceeds_total=c.reserve_exceeds_total, warning=_warning(snapshot, result),
        total=c.total, other_app_ratio=c.other_app_ratio,
        hot_cache_reserved=c.hot_cache_reserved, hot_cache_max=snapshot.guard.hot_cache_max,
        hot_cache_budget=c.hot_cache_budget,
        hot_cache_used=sum(w.memory.cache_bytes for w in snapshot.workers if w.state in LIVE_STATES),
        worker_ceiling=c.worker_ceiling,
        worker_abort_limit=c.worker_abort_limit, abort_limit=c.abort_limit,
        admission_ceiling=c.admission_ceiling, residency_ceiling=c.residency_ceiling,
        soft_threshold=c.soft_threshold, hard_threshold=c.hard_threshold, soft_bytes=c.soft,
        hard_bytes=c.hard, usage=result.usage, pressure_level=result.level,
        emergency=result.emergency, admission_paused=result.state.admission_paused,
        utilization=result.usage / c.ceiling if c.ceiling > 0 else 0.0,
        poll_interval=result.next_interval, workers=workers,
        device=device_pool(result, device_name), custom_device_ceiling=snapshot.guard.custom_device_ceiling,
        wire_weights=snapshot.guard.wire_weights, wired_stranded=c.wired_stranded,
        wired_advice=wired_limit_advice(c.static, c.total, c.gpu_cap_raw) if snapshot.guard.wire_weights else "",
    )


class DiskCacheStatus(DiskCacheCounters, frozen=True, kw_only=True):
    """The prompt cache's disk tier and shrink before drop (H5, H6 as proposed), as workers reported them.

    `max` is `[guard] disk_cache_max` (-1 "auto", 0 off); `budget` the budget in
    force and `bytes` every model's files, as the last worker to report measured
    them (0 until one has); `models` the bytes per model id. The counters run
    since the supervisor started: entries read back by requests, written at
    stops, dropped (a stop's deadline came first), evicted (least recently used,
    over the budget), and quantized in memory (with the bytes that returned).
    """

    max: int
    budget: int = 0
    bytes: int = 0
    entries: int = 0
    models: dict[str, int] = {}
    grace: float = 0.0          # [guard] disk_cache_grace: what a stop gives the write
    quantize_bits: int = 0      # [guard] cache_quantize_bits (0 = off)


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A configured or discovered model, loaded or not (`ps`, `/v1/models`, `status`).

    `estimated_bytes` is A2's estimate from the weight files; `usage` the
    measured U1 usage of its worker, so the two can be compared after a load.
    `expires_in` is how long until P10 unloads it (None: never).
    """

    id: str
    path: str
    pinned: bool
    state: str             # "unloaded", a worker state, or "failed"
    worker: str = ""
    pid: int = 0
    failed_reason: str = ""
    aliases: list[str] = []
    estimated_bytes: int = 0
    usage: int = 0
    mlx_active: int = 0
    mlx_pool: int = 0
    cache_bytes: int = 0
    disk_cache_bytes: int = 0     # H5 (proposed): its prompt-cache entries on disk, as last reported
    disk_cache_entries: int = 0
    batch_bytes: int = 0       # the decode batch's buffers ...
    batch_live_bytes: int = 0  # ... and its live KV
    # speculative decoding since the supervisor started: guessed tokens checked, and accepted
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    idle_seconds: float = 0.0
    ttl: float | None = None
    expires_in: float | None = None
    restarts: int = 0
    # W3: the seconds each phase of its last load took (supervisor.workers.load_clock), kept after an unload
    load_phases: dict[LoadPhase, float] = {}
    load_spare: bool = False  # ... and whether a spare worker took that load (W1)
    prefetched_bytes: int = 0  # W4: its weights read ahead into the page cache since it was last loaded


class ServerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What `status` and `GET /status` show: S1 plus the supervisor around it."""

    pid: int
    uptime: float
    runtime_dir: str
    pub: str
    http: str
    guard: GuardStatus
    models: list[ModelInfo]
    events: list[GuardEvent]          # S2, most recent last
    malformed_frames: int
    counters: dict[str, int]
    disk_cache: DiskCacheStatus = msgspec.field(default_factory=lambda: DiskCacheStatus(max=0))  # H5, H6 (proposed)
