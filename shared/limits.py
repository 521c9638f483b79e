"""The limits the supervisor hands to each worker (SPEC G).

The policy computes one `Limits` per worker every tick; the enforcer writes it
into the worker's limits block in the shared-memory ledger (read by the worker
before every prefill chunk) and also sends it as a `SetLimits` command. A value
of 0 for any byte limit means "no limit" (guard off).
"""

from __future__ import annotations

import msgspec

from shared.vocab import LimitBinding, Tier

# "1" in a worker's environment: leave MLX's cache limit alone (M1's pool bound). The
# pressure lab's P4 scenario sets it to stand for an allocator that does not honour its limit.
NO_CACHE_LIMIT_ENV = "MEMVISOR_NO_CACHE_LIMIT"


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Not keyword-only: the policy builds one positionally every tick
    (`supervisor.policy.ceilings.limits_for`), so a new field goes at the end.
    Travels by field name: the order is no part of the wire."""

    # Byte limits; all already reduced by the hot-cache reservation (C12).
    soft_limit: int = 0          # int(worker ceiling x soft threshold): over it only logs (G3)
    hard_limit: int = 0          # worker ceiling: ceiling - hot-cache reservation (G1)
    hard_watermark: int = 0      # int(worker ceiling x hard threshold)
    abort_limit: int = 0         # C10, minus the reservation: over it a prefill is aborted (G3)
    # Fractions (T4) and prefill chunking knobs (G2).
    abort_margin: float = 1.0
    prefill_headroom_safety: float = 1.0
    safe_zone_ratio: float = 0.89
    min_chunk_tokens: int = 256
    # Component ceilings, so a refusal can name what binds (C6).
    ceiling: int = 0
    static: int = 0
    dynamic: int = 0
    gpu_cap: int = 0
    binding: LimitBinding = ""
    tier: Tier = "balanced"
    admission_paused: bool = False  # P3: take no new request while another runs
    max_concurrency: int = 1     # P8: the walked cap on concurrent sequences
    # The worker's own allocator and prompt cache (SPEC H2, M1, M2); 0 = none / no limit.
    cache_cap: int = 0           # H2: this worker's share of [guard] hot_cache_max
    pool_max: int = 0            # M1: mx.set_cache_limit ([guard] pool_max, the P4 threshold)
    residency: int = 0           # M2: C8 residency ceiling, what the worker may wire (macOS)
    # D4: the discrete device pool's watermarks (group device bytes); 0 = no device pool.
    # A worker reports at once when the group's device bytes cross one (P9's wake-up).
    device_soft: int = 0
    device_hard: int = 0
