"""Typed inputs of the guard's policy (see supervisor.policy.pressure).

`HostCounters` is what the platform probes read from the OS each tick. Sizes
are bytes. A counter the OS would not give is None, and SPEC C2's fallbacks
apply: only `available` -> free = available; nothing -> dynamic = static.

`Snapshot` gathers everything one tick needs: the guard settings, the host
counters, one `WorkerRecord` per worker and the previous `PolicyState`. It is
also the replay trace's line format, so every type here round-trips through
JSON and has a JSON Schema (`python -m supervisor schema`).

Public names (stable): HostCounters, GuardSettings, WorkerRecord, PolicyState,
Snapshot. (Pressure levels: shared.vocab; worker states and their sets: shared.states.)
"""

from __future__ import annotations

import msgspec

from shared.host import HostCounters
from shared.limits import Limits
from shared.memory import NO_READING, MemoryReading
from shared.states import WorkerState
from shared.vocab import PressureLevel, Tier

# ---------------------------------------------------------------------------
# Everything else a policy tick needs. A Snapshot is also the replay trace's
# line format (one JSON object per line), so every type here is a plain
# msgspec Struct that round-trips through JSON and has a JSON Schema.

class GuardSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The guard's knobs as they are right now (config plus T6 runtime changes).

    `tier` is one of the tiers: a name from outside is normalised once, where it
    enters (T2: the config, `POST /admin/guard`, a replayed trace), so the tick
    never reads a name it has to check again.
    """

    enabled: bool = True
    tier: Tier = "balanced"
    custom_ceiling: int = 0              # C3 bytes, 0 = unset
    custom_device_ceiling: int = 0       # D2 bytes, 0 = unset (custom: balanced's device reserve)
    soft_threshold: float | None = None  # T5 raw overrides
    hard_threshold: float | None = None
    idle_timeout: float = 0.0            # P10 global TTL, seconds, 0 = never
    hot_cache_max: int = 0               # C12 budget shared by all workers, 0 = none
    safe_zone_ratio: float = 0.89        # G2, handed through in Limits
    min_chunk_tokens: int = 256          # G2, handed through in Limits
    wire_weights: bool = False           # M2: hand workers the residency ceiling to wire (macOS), else 0
    poll_interval: float = 1.0           # P9
    loaded_idle_interval: float = 10.0
    unloaded_idle_interval: float = 30.0
    pressure_reclaim_disabled: bool = False  # P4's environment switch
    pool_max: int = 2 * 1024**3          # M1: the pool a worker may keep; P4: larger is worth a grace reclaim
    spare_workers: int = 0               # W1: spare workers to keep ([supervisor] spare_workers; 0 = none)


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One worker process as the enforcer sees it this tick.

    `memory` is the worker's own latest reading (U1's usage, the footprint,
    MLX's counters, its prompt cache: `shared.memory.MemoryReading`), passed
    through unchanged from its ledger slot. `gpu_bytes` is the part of usage
    the unified-memory GPU holds (Metal; 0 elsewhere), worked out by the
    enforcer. `last_access` is the monotonic time the model last finished or
    started a request (the pool restarts it while busy, P10). `concurrency` is
    the walked cap now applied (0 = not set yet: the configured maximum). A
    worker id names one process: a respawn gets a new id or pid. A spare
    (SPEC W1) has no model: `model` is "" (model ids are never empty).
    """

    worker: str
    model: str
    state: WorkerState = "ready"
    pid: int = 0
    pinned: bool = False
    marked_for_unload: bool = False
    last_access: float = 0.0
    running: int = 0
    queued: int = 0
    memory: MemoryReading = NO_READING
    gpu_bytes: int = 0
    device_bytes: int = 0   # D1: held on a discrete device (NVML per process, else MLX active + pool)
    max_concurrency: int = 4
    concurrency: int = 0
    ttl: float | None = None
    restarts: int = 0

    @property
    def usage(self) -> int:
        """U1, the figure every rule compares (the reading's `usage`)."""
        return self.memory.usage


class PolicyState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the policy carries from one tick to the next (returned by `tick`).

    Not keyword-only: `tick` builds it positionally, in this order (17 keywords
    would cost a dict per call), so a new field goes at the end, and there too.
    """

    level: PressureLevel = "ok"
    over_ceiling_ticks: int = 0     # P2 consecutive ticks with usage >= ceiling
    grace_ticks: int = 0            # P4 grace ticks used in this pressure episode
    admission_paused: bool = False  # P3, as last decided
    no_reading_warned: bool = False  # C2: "no memory reading" already reported
    reserve_warned: bool = False    # C1: "tier reserves more than the machine" reported
    last_total: int = 0             # total of the last reading (used when host is None)
    interval: float = 0.0           # P9 interval chosen by the last tick (S1)
    limits: Limits | None = None    # common limits last handed out (max_concurrency=0)
    limited: dict[str, int] = {}    # worker id -> pid that received `limits`
    cache_kept: int = 0             # C12: the caches' bytes the limits handed out were built on ...
    reduced: dict[str, int] = {}    # ... and each worker's own share of them (its limits subtract the rest)
    caps: dict[str, int] = {}       # worker id -> the concurrency cap its limits carry (P8)
    usage_seen: dict[str, int] = {}  # worker id -> usage at `seen_at` (growth estimate, P6 at hard)
    seen_at: float = 0.0
    growth: float = 0.0             # bytes/s the non-draining workers grew by, last estimate
    device_over_ceiling_ticks: int = 0  # D4: P2's count on the device pool


class Snapshot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every input of one policy tick; one line of a replay trace.

    `now` is the caller's monotonic clock. `host` is None when the probe could
    not read the machine at all (then the last known total is used and no
    counter is available: C2's no-reading fallback). `recheck` marks the
    re-evaluation the enforcer runs right after acting (P7): it re-classifies
    and may act again, but does not count as a new tick for P2's over-ceiling
    count, P4's grace budget or P8's concurrency walk.
    """

    now: float
    guard: GuardSettings = GuardSettings()
    host: HostCounters | None = None
    supervisor_footprint: int = 0
    gpu_cap_raw: int = 0                 # C: unified memory (Metal) only; 0 on CUDA and CPU
    device_total: int = 0                # a discrete device's memory (CUDA): its own pool (D), never folded in
    device_free: int | None = None       # D1: free on that device now; None: no reading (dynamic = static)
    activity_hint: float | None = None   # P9: last "activity is coming" hint (monotonic)
    wired_stranded: int = 0              # M3: wired memory worker exits left behind (macOS), bytes
    recheck: bool = False
    workers: list[WorkerRecord] = []
    state: PolicyState = PolicyState()
    # W1, W2: what a new spare is expected to hold (the last waiting spare's usage; 0: none seen
    # yet), when the next may start after spares died (0: now), and model loads on their way
    spare_bytes: int = 0
    spare_due: float = 0.0
    loads_waiting: int = 0
