"""The prefill guard inside a worker (SPEC G1-G3), as pure functions.

Why a guard inside the worker at all: a prefill is the one moment a worker's
memory jumps by a large, predictable amount between two samples. The
supervisor polls; a long prompt can add gigabytes inside one poll interval.
The seed's in-process enforcer learned this the hard way (jetsam kills and a
frozen machine when a long prompt landed on an already full machine), so each
chunk is sized and checked *before* it runs, against limits the supervisor
hands down (`shared.limits.Limits`).

Everything here is arithmetic on numbers the engine passes in: the group's
usage (supervisor + all workers, SPEC U2), the tokens left, and a running cost
estimate. No MLX, no clock, no I/O, so every edge is a table test.

A byte limit of 0 means "no limit" (guard off, SPEC C5): every function then
lets the prefill run at full chunk size.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from shared.limits import Limits

COST_PAD = 1.3  # G2: the running per-token estimate is padded by 30%
PREFILL_MEMORY_EXCEEDED = "prefill_memory_exceeded"


class PrefillCost(msgspec.Struct, frozen=True):
    """What one more prompt token costs, as the engine currently estimates it.

    `kv_per_token` stays for the life of the sequence (its KV cache);
    `chunk_per_token` is the peak growth per token *while a chunk runs*
    (KV plus the transient activations of that chunk), measured by the engine
    from MLX's peak counter and kept as a running estimate.
    """

    kv_per_token: float
    chunk_per_token: float
    measured: bool = False  # False: still the prior (worker.prefill_cost), nothing learned yet


class Limit(msgspec.Struct, frozen=True):
    """The tightest byte limit a prefill must stay under and what sets it (C6)."""

    bytes: int
    binding: str


class Preflight(msgspec.Struct, frozen=True):
    """G1 verdict for a new request's prefill.

    `fits`: go. `evict`: ask the supervisor to free `need_bytes` by stopping
    idle LRU models, then run preflight again with `retried=True`. `reject`:
    fail the request with `prefill_memory_exceeded`, estimated vs limit bytes.
    """

    verdict: Literal["fits", "evict", "reject"]
    estimated_bytes: int = 0
    limit_bytes: int = 0
    binding: str = ""
    need_bytes: int = 0


class ChunkPlan(msgspec.Struct, frozen=True):
    """G2: how many tokens the next chunk may hold; 0 tokens means abort."""

    tokens: int
    estimated_bytes: int = 0
    limit_bytes: int = 0
    binding: str = ""


AfterChunk = Literal["ok", "over_soft", "over_abort"]


def abort_binding(limits: Limits) -> str:
    """C10: the abort limit is static, or the GPU cap plus CPU side when smaller."""
    return "gpu_cap" if 0 < limits.gpu_cap < limits.static else "static"


def prefill_limit(limits: Limits) -> Limit:
    """G1: the hard limit, tightened by abort limit x abort margin; 0 = no limit."""
    candidates = []
    if limits.hard_limit > 0:
        candidates.append(Limit(limits.hard_limit, limits.binding or "static"))
    if limits.abort_limit > 0:
        candidates.append(Limit(int(limits.abort_limit * limits.abort_margin), abort_binding(limits)))
    if not candidates:
        return Limit(0, "")
    return min(candidates, key=lambda limit: limit.bytes)


def chunk_target(limits: Limits) -> Limit:
    """G2: min(hard x headroom safety, abort limit x abort margin); 0 = no limit."""
    candidates = []
    if limits.hard_limit > 0:
        candidates.append(Limit(int(limits.hard_limit * limits.prefill_headroom_safety),
                                limits.binding or "static"))
    if limits.abort_limit > 0:
        candidates.append(Limit(int(limits.abort_limit * limits.abort_margin), abort_binding(limits)))
    if not candidates:
        return Limit(0, "")
    return min(candidates, key=lambda limit: limit.bytes)


def estimate_prefill_peak(tokens: int, cost: PrefillCost, chunk_tokens: int) -> int:
    """Peak bytes a chunked prefill of `tokens` adds: KV for all, activations for one chunk."""
    if tokens <= 0:
        return 0
    in_chunk = min(tokens, max(1, chunk_tokens))
    raw = (tokens - in_chunk) * cost.kv_per_token + in_chunk * max(cost.chunk_per_token,
                                                                   cost.kv_per_token)
    return math.ceil(raw * COST_PAD)


def preflight(
    limits: Limits,
    usage: int,
    tokens: int,
    cost: PrefillCost,
    *,
    own_usage: int = 0,
    retried: bool = False,
    extra_bytes: int = 0,
) -> Preflight:
    """G1: can a prefill of `tokens` fit on top of the group's `usage` at all?

    The peak is estimated with the smallest chunk G2 may use (min_chunk_tokens):
    G2 shrinks chunks to the headroom, so a prompt that fits in floor-sized
    chunks needs no eviction; asking the supervisor to stop other models
    because full-size chunks would not fit would trade someone's model for a
    faster prefill.

    `own_usage` is this worker's part of `usage`. When the prefill would not
    fit even if every other model were stopped, eviction cannot help, so the
    request is rejected at once instead of costing other users their models.

    `extra_bytes` is memory the prefill needs besides its tokens: the copy of
    a prefix reused from the prompt cache (H1), whose tokens are not counted.
    """
    limit = prefill_limit(limits)
    if limit.bytes == 0:
        return Preflight("fits")
    peak = estimate_prefill_peak(tokens, cost, limits.min_chunk_tokens) + max(0, extra_bytes)
    if usage + peak <= limit.bytes:
        return Preflight("fits", usage + peak, limit.bytes, limit.binding)
    hopeless = own_usage + peak > limit.bytes
    if retried or hopeless:
        return Preflight("reject", usage + peak, limit.bytes, limit.binding)
    return Preflight("evict", usage + peak, limit.bytes, limit.binding,
                     need_bytes=usage + peak - limit.bytes)


def next_chunk(
    limits: Limits,
    usage: int,
    remaining: int,
    cost: PrefillCost,
    max_chunk: int,
    *,
    done: int = 0,
) -> ChunkPlan:
    """G2: size the next prefill chunk from the headroom left under the chunk target.

    Below soft x safe-zone ratio a chunk is full size; above it the chunk
    shrinks in proportion to the headroom left, and never beyond what the
    padded per-token cost says fits. The floor is `min_chunk_tokens` (or the
    tokens left, if fewer); when even the floor does not fit, the answer is 0
    tokens: abort the request rather than push the machine over. `done` is
    how many prompt tokens the sequence's cache already holds.
    """
    if remaining <= 0:
        return ChunkPlan(0)
    full = max(1, min(max_chunk, remaining))
    target = chunk_target(limits)
    if target.bytes == 0:
        return ChunkPlan(full)
    per_token = max(cost.chunk_per_token, cost.kv_per_token) * COST_PAD
    room = target.bytes - usage
    safe = int(limits.soft_limit * limits.safe_zone_ratio) if limits.soft_limit > 0 else target.bytes
    chunk = full
    if usage > safe:
        span = target.bytes - safe
        chunk = int(full * max(0, room) / span) if span > 0 else 0
    fits = int(room // per_token) if per_token > 0 and room > 0 else (full if room > 0 else 0)
    chunk = min(chunk, fits, full)
    floor = min(max(1, limits.min_chunk_tokens), remaining)
    if chunk >= floor:
        return ChunkPlan(chunk, usage + math.ceil(chunk * per_token), target.bytes, target.binding)
    floor_bytes = math.ceil(floor * per_token)
    if floor_bytes <= room:
        return ChunkPlan(floor, usage + floor_bytes, target.bytes, target.binding)
    return ChunkPlan(0, usage + floor_bytes, target.bytes, target.binding)


def after_chunk(limits: Limits, usage: int) -> AfterChunk:
    """G3: over the abort limit the engine reclaims and re-checks; over soft only logs."""
    if limits.abort_limit > 0 and usage > limits.abort_limit:
        return "over_abort"
    if limits.soft_limit > 0 and usage > limits.soft_limit:
        return "over_soft"
    return "ok"


def rejection_message(estimated: int, limit: int, binding: str) -> str:
    """The 400 `prefill_memory_exceeded` text: numbers plus the remedy that fits (C6)."""
    from shared.sizes import format_size

    remedy = {
        "dynamic": "close other applications to free memory",
        "gpu_cap": "raise the GPU memory cap (iogpu.wired_limit_mb)",
    }.get(binding, "use a shorter prompt, a smaller model or a lower tier")
    return (
        f"prompt needs about {format_size(estimated)} during prefill but the limit is "
        f"{format_size(limit)} (binding: {binding or 'static'}); {remedy}"
    )
