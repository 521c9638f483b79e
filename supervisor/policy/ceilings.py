"""How much memory the guarded group may use right now (SPEC T1, T3-T5, C1-C14).

Pure arithmetic on numbers the probes read; nothing here touches the machine.
The formulas model unified memory (Apple silicon, and CPU-only machines where
the GPU terms are 0). The ceiling is the smallest of three candidates:

- static (C1): the machine minus the tier's reserve; never moves.
- dynamic (C2/C3): what the group holds plus what the OS could hand over now,
  minus the reserve, so the ceiling shrinks as other apps grow.
- gpu cap (C4): the accelerator's allocation cap plus CPU-side bytes.

A value of 0 for a limit means "no limit" to every consumer, which is why the
floors below are 1 byte and never 0 where a limit exists. (They are spelled
`x if x > 1 else 1`, not `max(1, x)`: every tick works them out, and a call of
the builtin min or max costs about 1k instructions in CPython 3.11.)

Public names (stable): Ceilings, TierPreview, compute_ceilings, limits_for,
worker_limit, hot_cache_budget, tier_preview, remedy, reserve_message,
wired_limit_suggestion, wired_limit_advice.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.host import HostCounters
from shared.limits import Limits
from shared.sizes import MiB, format_size
from shared.vocab import HostBinding, Tier
from supervisor.policy.pools import first_binding, pool_marks, previews, remedy
from supervisor.policy.pools import reserve_message as pool_reserve_message
from supervisor.policy.tiers import TIER_PARAMS, other_app_ratio, reserve_bytes, resolve_thresholds

__all__ = [
    "Ceilings",
    "TierPreview",
    "compute_ceilings",
    "hot_cache_budget",
    "limits_for",
    "remedy",
    "reserve_message",
    "tier_preview",
    "wired_limit_advice",
    "wired_limit_suggestion",
    "worker_limit",
]

# H2 (2026-12-01): the prompt caches together never hold more than this share
# of the soft watermark, so the default budget works under any ceiling.
HOT_CACHE_SOFT_SHARE = 4

Reading = Literal["counters", "available", "none"]


class Ceilings(msgspec.Struct, frozen=True, gc=False):
    """Every ceiling-derived number of one tick (S1 reports most of them).

    Not keyword-only: `compute_ceilings` builds it positionally, in this order
    (see there why); a new field goes at the end, and there too.

    A candidate that does not apply is 0 (dynamic for an unset custom ceiling,
    gpu_cap without a known cap). `ceiling` 0 means the guard is off.
    """

    enabled: bool
    tier: Tier
    total: int
    reserve: int
    reserve_exceeds_total: bool  # C1: static had to be floored to 1 byte
    reading: Reading             # C2: which host counters were available
    free: int
    inactive: int                # inactive + active file-backed pages
    other_apps: int
    other_app_ratio: float
    own: int
    own_gpu: int
    static: int
    dynamic: int
    gpu_cap: int                 # C4 effective (raw + CPU side)
    gpu_cap_raw: int
    ceiling: int                 # C5
    binding: HostBinding         # C6 (guard off: "")
    admission_ceiling: int       # C7
    admission_binding: HostBinding
    residency_ceiling: int       # C8
    admission_soft_target: int   # C9
    abort_limit: int             # C10
    soft_threshold: float        # T5 in force
    hard_threshold: float
    headroom_safety: float       # T4
    abort_margin: float          # T4
    soft: int                    # C11
    hard: int
    hot_cache_reserved: int      # C12: the bytes the prompt caches hold now (measured)
    hot_cache_budget: int        # H2: min(hot_cache_max, soft // 4), the budget in force
    worker_ceiling: int          # ceiling minus every cache (C12): a worker that holds none gets this
    worker_abort_limit: int      # abort limit minus every cache (C12)
    wired_stranded: int = 0      # M3: wired memory exits left behind, off static and the GPU cap


def _reading_kind(host: HostCounters | None) -> Reading:
    if host is None:
        return "none"
    if host.free is not None:
        return "counters"
    return "available" if host.available is not None else "none"


def _dynamic_terms(
    tier: Tier, host: HostCounters | None, own: int, own_gpu: int, reserve: int, static: int
) -> tuple[Reading, int, int, int, int]:
    """C2: (reading, free, inactive_term, other_apps, dynamic).

    The full counters are used when `free` is known (missing inactive, file
    or active counters count as 0); else `available` alone; else nothing, and
    dynamic falls back to static so the guard keeps running on the fixed cap.
    """
    if host is None or (host.free is None and host.available is None):
        return "none", 0, 0, 0, static
    if host.free is None:
        free = host.available or 0
        dynamic = own + free - reserve
        return "available", free, 0, 0, dynamic if dynamic > 1 else 1
    free = host.free
    inactive = host.inactive or 0
    file_active = (host.file_backed or 0) - inactive
    file_active = file_active if file_active > 0 else 0
    inactive_term = inactive + file_active
    ratio = other_app_ratio(tier, host.compressor)
    other_apps = 0
    if ratio > 0:
        own_cpu = own - own_gpu if own > own_gpu else 0
        anonymous = (host.active or 0) - file_active - own_cpu
        other_apps = int(anonymous * ratio) if anonymous > 0 else 0
    # Other apps may already hold the reserve: 1 byte, never 0 ("no limit").
    dynamic = own + free + inactive_term + other_apps - reserve
    dynamic = dynamic if dynamic > 1 else 1
    return "counters", free, inactive_term, other_apps, dynamic


def worker_limit(limit: int, others: int) -> int:
    """C12: a limit handed to a worker, less the other workers' cache bytes.

    Its own cache is not subtracted: it gives way first (H4). The limit is
    never clamped to a meaningless value: when the caches hold as much as the
    limit itself (a ceiling lowered under them), nothing is subtracted -- the
    caches are then dropped (H3, `cache_room`) and the worker keeps the
    group's real limit rather than 1 byte that no watermark could cross.
    0 stays 0 ("no limit").
    """
    if limit <= 0 or others <= 0:
        return limit if limit > 0 else 0
    left = limit - others
    return left if left > 0 else limit


def hot_cache_budget(hot_cache_max: int, soft: int) -> int:
    """H2 (2026-12-01): min(hot_cache_max, soft watermark // 4); hot_cache_max alone with no watermark (guard off)."""
    if hot_cache_max <= 0:
        return 0
    if soft <= 0:
        return hot_cache_max
    share = soft // HOT_CACHE_SOFT_SHARE
    return share if share < hot_cache_max else hot_cache_max


_TIER_TERMS: dict[tuple[Tier, int, float | None, float | None], tuple[int, float, float]] = {}
_TIER_TERMS_MAX = 64


def _tier_terms(tier: Tier, total: int, soft: float | None, hard: float | None) -> tuple[int, float, float]:
    """(T1's reserve, T5's soft and hard fractions) for this tier on a `total`-byte machine, remembered.

    The tier, the machine's size and the thresholds stay put from tick to
    tick, and working them out again (clamps of a float, the legacy checks)
    took about 9k instructions, 1 us of every tick. Emptied when full, as
    `decisions.size_text`; still pure: no input changes what a call returns.
    """
    key = (tier, total, soft, hard)
    terms = _TIER_TERMS.get(key)
    if terms is None:
        if len(_TIER_TERMS) >= _TIER_TERMS_MAX:
            _TIER_TERMS.clear()
        soft_t, hard_t = resolve_thresholds(tier, soft, hard)
        terms = _TIER_TERMS[key] = (reserve_bytes(tier, total), soft_t, hard_t)
    return terms


def compute_ceilings(
    *,
    tier: Tier,
    enabled: bool = True,
    total: int,
    host: HostCounters | None,
    own: int,
    own_gpu: int = 0,
    gpu_cap_raw: int = 0,
    custom_ceiling: int = 0,
    soft_threshold: float | None = None,
    hard_threshold: float | None = None,
    hot_cache_max: int = 0,
    hot_cache_used: int = 0,
    stranded: int = 0,
) -> Ceilings:
    """C1-C12 for one tick. `tier` must already be normalised (T2).

    `total` is the machine's memory (already capped by a container limit or a
    budget); `own`/`own_gpu` the group's footprint and its GPU share.

    `stranded` is wired memory that worker exits left behind (M3, macOS): the
    kernel holds it for nobody until a reboot, so it is taken off static (C1)
    and the GPU cap (C4, C8, C10), the candidates that do not read the host's
    counters. Not off dynamic (C2): wired pages are neither free, inactive nor
    active, so dynamic already leaves them out, and not into `other_apps`,
    which is the share of other apps' memory the OS could compress away.
    """
    params = TIER_PARAMS[tier]
    reserve, soft_t, hard_t = _tier_terms(tier, total, soft_threshold, hard_threshold)
    stranded = stranded if stranded > 0 else 0
    static = total - reserve
    reserve_exceeds = static <= 0
    static -= stranded
    static = static if static > 1 else 1  # C1: never 0, which would read as "no limit"
    gpu_room = max(1, gpu_cap_raw - stranded) if gpu_cap_raw > 0 else 0  # the raw cap, less what is stranded
    if tier == "custom":
        reading = _reading_kind(host)
        free = inactive = other_apps = 0
        dynamic = custom_ceiling if custom_ceiling > 0 else 0  # C3: 0 is not a candidate
    else:
        reading, free, inactive, other_apps, dynamic = _dynamic_terms(
            tier, host, own, own_gpu, reserve, static
        )
    cpu_side = max(0, own - own_gpu) if own_gpu > 0 else 0
    gpu_cap = gpu_room + cpu_side if gpu_room > 0 else 0

    best = static  # C5: the smallest candidate; dynamic and the GPU cap only when they are one
    if 0 < dynamic < best:
        best = dynamic
    if 0 < gpu_cap < best:
        best = gpu_cap
    ceiling, admission_ceiling, soft_target, soft, hard = pool_marks(enabled, best, static, soft_t, hard_t)
    binding: HostBinding = first_binding(ceiling, (("static", static), ("dynamic", dynamic), ("gpu_cap", gpu_cap)), "")
    residency = (min(static, gpu_room) if gpu_room > 0 else static) if enabled else 0
    abort_limit = (min(static, gpu_cap) if gpu_room > 0 else static) if enabled else 0
    # C12 (2026-12-01): what the caches hold now, never room they might grow into
    reserved = hot_cache_used if hot_cache_used > 0 and (ceiling > 0 or abort_limit > 0) else 0
    # positionally, in field order: 35 keywords would make CPython 3.11 build and unpack a
    # dict on every call (over 15 keywords; ~10k instructions, 1 us, of every tick)
    return Ceilings(
        enabled, tier, total, reserve, reserve_exceeds, reading, free, inactive, other_apps,
        other_app_ratio(tier, True if host is None else host.compressor),  # other_app_ratio
        own, own_gpu, static, dynamic, gpu_cap, gpu_cap_raw, ceiling, binding,
        admission_ceiling, binding if enabled else "static",  # admission_ceiling, admission_binding
        residency, soft_target, abort_limit,  # residency_ceiling, admission_soft_target, abort_limit
        soft_t, hard_t, params.headroom_safety, params.abort_margin, soft, hard,
        reserved, hot_cache_budget(hot_cache_max, soft),  # hot_cache_reserved, hot_cache_budget
        worker_limit(ceiling, reserved), worker_limit(abort_limit, reserved),  # worker_ceiling, worker_abort_limit
        stranded,  # wired_stranded
    )


def limits_for(
    c: Ceilings,
    *,
    admission_paused: bool,
    safe_zone_ratio: float = 0.89,
    min_chunk_tokens: int = 256,
    max_concurrency: int = 0,
    cache_cap: int = 0,
    pool_max: int = 0,
    others_cache: int | None = None,
    wire_weights: bool = False,
) -> Limits:
    """Everything SPEC G needs inside a worker, from this tick's ceilings.

    The soft limit and the hard watermark are the group's own watermarks (C11),
    so the sample a worker sends at once when the group crosses one (P9)
    comes at the crossing the guard acts on. The hard limit and the abort
    limit are the ceiling and C10 less the other workers' cache bytes
    (`others_cache`, C12; None: every cache, as for a worker holding none);
    the component ceilings ride along so a rejected prefill can name what
    binds (C6). `max_concurrency` 0 means "the policy's SetConcurrency
    decisions carry the cap" (P8). The residency ceiling (C8) is what a macOS
    worker may wire, handed out only with `wire_weights` (M2, 2026-12-05); 0 wires nothing.
    """
    others = c.hot_cache_reserved if others_cache is None else others_cache
    on = c.enabled
    # positionally, in field order (19 keywords: a dict built and unpacked per call, as Ceilings)
    return Limits(
        c.soft, worker_limit(c.ceiling, others), c.hard, worker_limit(c.abort_limit, others),
        c.abort_margin, c.headroom_safety, safe_zone_ratio, min_chunk_tokens,  # ... prefill_headroom_safety
        c.ceiling, c.static if on else 0, c.dynamic if on else 0, c.gpu_cap if on else 0,  # ceiling ... gpu_cap
        c.binding, c.tier, admission_paused, max_concurrency, cache_cap, pool_max,
        c.residency_ceiling if wire_weights else 0,  # residency
    )


def reserve_message(c: Ceilings) -> str:
    """C1: the words for a tier that reserves more than the machine has ("" otherwise)."""
    return pool_reserve_message("host", c.tier, c.reserve, c.total, c.reserve_exceeds_total)


class TierPreview(msgspec.Struct, frozen=True, kw_only=True):
    """C14: one tier's ceiling right now. Field names are a contract (docs/operations.md)."""

    reserve_bytes: int
    free_bytes: int
    inactive_bytes: int
    other_apps_bytes: int
    static_bytes: int
    dynamic_bytes: int
    gpu_cap_bytes: int
    ceiling_bytes: int
    binding: HostBinding
    soft_bytes: int
    hard_bytes: int


def tier_preview(
    host: HostCounters | None,
    own: int,
    own_gpu: int = 0,
    gpu_cap_raw: int = 0,
    custom_ceiling: int = 0,
    soft_threshold: float | None = None,
    hard_threshold: float | None = None,
) -> dict[str, TierPreview]:
    """C14: what every tier's ceiling would be on these inputs.

    `custom` measures nothing: it shows its fixed reserve, static, the GPU cap
    and its user ceiling as `dynamic_bytes` (0 when unset, not a candidate).
    Thresholds follow T5 per tier, as they would if that tier were chosen.
    """
    total = host.total if host is not None else 0

    def ceilings(tier: Tier) -> Ceilings:
        return compute_ceilings(tier=tier, total=total, host=host, own=own, own_gpu=own_gpu, gpu_cap_raw=gpu_cap_raw,
                                custom_ceiling=custom_ceiling, soft_threshold=soft_threshold,
                                hard_threshold=hard_threshold)

    def line(c: Ceilings) -> TierPreview:
        return TierPreview(reserve_bytes=c.reserve, free_bytes=c.free, inactive_bytes=c.inactive,
                           other_apps_bytes=c.other_apps, static_bytes=c.static, dynamic_bytes=c.dynamic,
                           gpu_cap_bytes=c.gpu_cap, ceiling_bytes=c.ceiling, binding=c.binding, soft_bytes=c.soft,
                           hard_bytes=c.hard)

    return previews(ceilings, line)


def wired_limit_suggestion(desired: int, total: int) -> int:
    """C13: the wired limit to suggest, never within 5% of RAM, whole MiB.

    Wiring within a few GiB of physical RAM invited jetsam during large model
    loads, and a killed process stranded its wired memory until reboot; 5% is
    the margin that held in the field. `iogpu.wired_limit_mb` takes whole MiB,
    so the figure is floored to a value the kernel can actually be given.
    """
    suggestion = max(0, desired)
    if total > 0:
        suggestion = min(suggestion, total - total // 20)
    return suggestion // MiB * MiB


def wired_limit_advice(desired: int, total: int, gpu_cap_raw: int) -> str:
    """C13: the sysctl line to show when the GPU cap is below the suggestion ("" if none).

    Also warns when the cap already wires within 5% of RAM.
    """
    if gpu_cap_raw <= 0:
        return ""
    if total > 0 and gpu_cap_raw > total - total // 20:
        return (
            f"the GPU cap ({format_size(gpu_cap_raw)}) leaves the OS less than 5% of "
            f"{format_size(total)}; a large model load can trigger jetsam and strand wired "
            f"memory until reboot. Recommended maximum: "
            f"sudo sysctl iogpu.wired_limit_mb={(total - total // 20) // MiB}"
        )
    suggestion = wired_limit_suggestion(desired, total)
    if gpu_cap_raw >= suggestion:
        return ""
    return (
        f"the GPU cap ({format_size(gpu_cap_raw)}) is below the static ceiling "
        f"({format_size(desired)}); raise it with: "
        f"sudo sysctl iogpu.wired_limit_mb={suggestion // MiB}"
    )
