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
from typing import Callable, Literal

import msgspec

from shared.limits import Limits
from shared.vocab import FailureCode, LimitBinding

COST_PAD = 1.3  # G2: the running estimate of a chunk's cost is padded by 30%
PREFILL_MEMORY_EXCEEDED: FailureCode = "prefill_memory_exceeded"
DEVICE: LimitBinding = "device"  # the binding of a limit of the discrete device's pool (SPEC D)


class PrefillCost(msgspec.Struct, frozen=True):
    """What a chunk of prompt tokens costs, as the engine currently estimates it.

    Why more than a per-token figure: the first model (KV plus a per-token
    activation cost) barely followed the prompt, because what a chunk
    allocates besides its KV grows with the context it attends to. Measured
    with `scripts/bench_prefill_peak.py`, a chunk of `n` tokens that brings
    the cache to `c` tokens adds, above the usage before it:

    * the KV cache's growth: `kv_per_token` for every token, allocated in
      blocks of `kv_step` tokens (mlx_lm's KVCache grows by 256);
    * `n x chunk_per_token`: the activations of one layer at a time (the
      residual stream, q/k/v, the MLP's intermediate), not kept;
    * `n x c x score_per_pair`: the attention scores (MLX's CPU attention is
      not fused: scores, mask and softmax are arrays of heads x n x c);
    * `c x context_per_token`: a layer's KV copied while the cache grows;
    * `kv_slack x` the KV's growth: what the process footprint (SPEC U1, what
      the guard compares) holds beyond MLX's own peak as the cache grows by
      copies (freed buffers the allocator keeps resident).

    `scale` is what the running estimate learned (G2): measured / modelled
    transient bytes, never below 1, so an architecture the model does not
    know is corrected by its first chunk. `measured` is False while the cost
    is still the prior (`worker.prefill_cost`).
    """

    kv_per_token: float
    chunk_per_token: float
    score_per_pair: float = 0.0
    context_per_token: float = 0.0
    kv_slack: float = 0.0
    kv_step: int = 1
    scale: float = 1.0
    measured: bool = False


class Limit(msgspec.Struct, frozen=True):
    """The tightest byte limit a prefill must stay under and what sets it (C6)."""

    bytes: int
    binding: LimitBinding


class Preflight(msgspec.Struct, frozen=True):
    """G1 verdict for a new request's prefill.

    `fits`: go. `evict`: ask the supervisor to free `need_bytes` by stopping
    idle LRU models, then run preflight again with `retried=True`. `reject`:
    fail the request with `prefill_memory_exceeded`, estimated vs limit bytes.
    """

    verdict: Literal["fits", "evict", "reject"]
    estimated_bytes: int = 0
    limit_bytes: int = 0
    binding: LimitBinding = ""
    need_bytes: int = 0


class ChunkPlan(msgspec.Struct, frozen=True):
    """G2: how many tokens the next chunk may hold; 0 tokens means abort."""

    tokens: int
    estimated_bytes: int = 0
    limit_bytes: int = 0
    binding: LimitBinding = ""


AfterChunk = Literal["ok", "over_soft", "over_abort"]


def guard_on(limits: Limits) -> bool:
    """False when every byte limit is 0 (guard off, C5): prefills then run unchecked."""
    return limits.hard_limit > 0 or limits.abort_limit > 0 or limits.soft_limit > 0


def abort_binding(limits: Limits) -> LimitBinding:
    """C10: the abort limit is static, or the GPU cap plus CPU side when smaller; the device's."""
    if limits.binding == DEVICE:
        return DEVICE
    return "gpu_cap" if 0 < limits.gpu_cap < limits.static else "static"


def device_limits(limits: Limits) -> Limits:
    """G1-G3 on a discrete device's pool (SPEC D): the limits to hold a prefill's peak to there.

    On CUDA a prefill's KV and activations are device memory, which the host
    limits do not hold (D5 counts a model's weights on the device and not in
    RAM; its prefill is the same memory). The one device limit a worker is
    handed is the device pool's hard watermark (`device_hard`, in the
    workers' own measure: MLX active + pool), above which the guard acts on
    the device pool (P6 at hard), so it stands in for the hard limit (G1),
    the chunk target's base (G2, times the headroom safety) and the abort
    limit (G3); `device_soft` for soft. Usage is then the group's device
    bytes. A refusal's binding is `device`.
    """
    return msgspec.structs.replace(
        limits, soft_limit=limits.device_soft, hard_limit=limits.device_hard, hard_watermark=limits.device_hard,
        abort_limit=limits.device_hard, abort_margin=1.0, ceiling=0, static=0, dynamic=0, gpu_cap=0,
        binding=DEVICE)


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


def kv_bytes(cost: PrefillCost, tokens: int) -> float:
    """Bytes of KV cache allocated for `tokens` tokens (whole `kv_step` blocks)."""
    step = max(1, cost.kv_step)
    return -(-max(0, tokens) // step) * step * cost.kv_per_token


def transient_bytes(cost: PrefillCost, done: int, tokens: int, *, scaled: bool = True) -> float:
    """Bytes a chunk of `tokens` allocates and frees again, on top of `done` cached tokens."""
    if tokens <= 0:
        return 0.0
    context = done + tokens
    raw = (tokens * cost.chunk_per_token + tokens * context * cost.score_per_pair
           + context * cost.context_per_token)
    return raw * max(1.0, cost.scale) if scaled else raw


def chunk_bytes(cost: PrefillCost, done: int, tokens: int) -> int:
    """Peak bytes one chunk adds above the usage before it (G2): its KV growth, with the
    footprint's slack on it, plus its transient."""
    if tokens <= 0:
        return 0
    grown = kv_bytes(cost, done + tokens) - kv_bytes(cost, done)
    return math.ceil(grown * (1.0 + cost.kv_slack) + transient_bytes(cost, done, tokens))


def estimate_prefill_peak(tokens: int, cost: PrefillCost, chunk_tokens: int, *, done: int = 0) -> int:
    """G1: peak bytes a prefill of `tokens` in chunks of `chunk_tokens` adds (no padding).

    The KV of every earlier chunk stays (with the footprint's slack: the
    cache grew by copies); the chunk running adds its own KV and transient.
    The transient grows with the context, so the peak is at the last full
    chunk or the last (shorter) one: both are computed. `done` tokens are
    already cached (a prompt-cache hit): their KV is in the usage already,
    but the new chunks attend to them.
    """
    def own(start: int, n: int) -> float:
        return kv_bytes(cost, start + n) - kv_bytes(cost, start) + transient_bytes(cost, start, n)

    return _peak(tokens, cost, chunk_tokens, done, own)


def admission_peak(tokens: int, cost: PrefillCost, chunk_tokens: int, *, done: int = 0) -> int:
    """What G1 compares with its limit: the estimate, with the chunk in flight counted as G2
    will count it (`padded_chunk_bytes`), so a prompt G1 lets in is not aborted by G2's pad
    at its last chunk under the same limit. At most COST_PAD x one chunk above the estimate."""
    return _peak(tokens, cost, chunk_tokens, done, lambda start, n: padded_chunk_bytes(cost, start, n))


def _peak(tokens: int, cost: PrefillCost, chunk_tokens: int, done: int,
          own: Callable[[int, int], float]) -> int:
    if tokens <= 0:
        return 0
    chunk = max(1, min(chunk_tokens, tokens))
    base = kv_bytes(cost, done)
    last_start = done + (tokens - 1) // chunk * chunk
    peaks = [(kv_bytes(cost, start) - base) * (1.0 + cost.kv_slack) + own(start, min(chunk, done + tokens - start))
             for start in {last_start, max(done, last_start - chunk)}]
    return math.ceil(max(peaks))


def preflight(
    limits: Limits,
    usage: int,
    tokens: int,
    cost: PrefillCost,
    *,
    own_usage: int = 0,
    retried: bool = False,
    extra_bytes: int = 0,
    done: int = 0,
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
    a prefix reused from the prompt cache (H1), whose tokens are not counted;
    `done` is that prefix's length (the new tokens attend to it).

    The estimate is not padded as a whole: it is built to stay at or above
    the measured peak (within 25 %), and padding all of it would
    refuse, or cost someone their idle model for, prompts that fit. Only the
    chunk in flight is counted padded, as G2 will count it (`admission_peak`).
    """
    limit = prefill_limit(limits)
    if limit.bytes == 0:
        return Preflight("fits")
    peak = admission_peak(tokens, cost, limits.min_chunk_tokens, done=done) + max(0, extra_bytes)
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
    padded cost of a chunk (`chunk_bytes` x COST_PAD, on top of the `done`
    tokens already cached) says fits. The floor is `min_chunk_tokens` (or the
    tokens left, if fewer); when even the floor does not fit, the answer is 0
    tokens: the request waits for room (`floor_room`) or is refused, rather
    than push the machine over.
    """
    if remaining <= 0:
        return ChunkPlan(0)
    full = max(1, min(max_chunk, remaining))
    target = chunk_target(limits)
    if target.bytes == 0:
        return ChunkPlan(full)
    room = target.bytes - usage
    safe = int(limits.soft_limit * limits.safe_zone_ratio) if limits.soft_limit > 0 else target.bytes
    chunk = full
    if usage > safe:
        span = target.bytes - safe
        chunk = int(full * max(0, room) / span) if span > 0 else 0
    chunk = min(chunk, _most_that_fit(cost, done, full, room))
    floor = min(max(1, limits.min_chunk_tokens), remaining)
    if chunk >= floor:
        return ChunkPlan(chunk, usage + padded_chunk_bytes(cost, done, chunk), target.bytes, target.binding)
    floor_bytes = padded_chunk_bytes(cost, done, floor)
    if floor_bytes <= room:
        return ChunkPlan(floor, usage + floor_bytes, target.bytes, target.binding)
    return ChunkPlan(0, usage + floor_bytes, target.bytes, target.binding)


def floor_room(plan: ChunkPlan, usage: int, own_usage: int, *, retried: bool) -> Preflight:
    """G2 (revised 2026-12-05) when not even the floor chunk fits (`plan.tokens` 0): ask for room as G1 does.

    Why: G1 judges a prompt against the hard limit, G2 each chunk against the
    lower chunk target (hard x headroom safety). A prompt G1 let through with
    the group's usage just under soft was refused at its first floor chunk
    while an idle 300 MiB model kept its memory: G1 would have asked the
    supervisor to stop it. So the floor chunk asks too, with G1's meaning of
    `need_bytes` (usage + the chunk's padded peak - its limit, the shortfall),
    once per request (`retried`), and not when evicting every other model
    could not help (`own_usage` + the chunk is over the limit by itself).
    `reject` is the `prefill_memory_exceeded` refusal with the plan's numbers.
    """
    need = plan.estimated_bytes - plan.limit_bytes
    hopeless = own_usage + (plan.estimated_bytes - usage) > plan.limit_bytes
    if retried or hopeless or need <= 0:
        return Preflight("reject", plan.estimated_bytes, plan.limit_bytes, plan.binding)
    return Preflight("evict", plan.estimated_bytes, plan.limit_bytes, plan.binding, need_bytes=need)


def padded_chunk_bytes(cost: PrefillCost, done: int, tokens: int) -> int:
    """G2's view of a chunk: the running estimate x COST_PAD."""
    return math.ceil(chunk_bytes(cost, done, tokens) * COST_PAD)


def _most_that_fit(cost: PrefillCost, done: int, most: int, room: int) -> int:
    """The largest chunk (<= `most`) whose padded cost fits in `room`; 0 if none.

    A chunk's cost only grows with its size, so a bisection finds it in a
    dozen steps whatever the cost model's terms.
    """
    if room <= 0:
        return 0
    if padded_chunk_bytes(cost, done, most) <= room:
        return most
    low, high = 0, most  # padded(low) fits (or low is 0), padded(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        if padded_chunk_bytes(cost, done, middle) <= room:
            low = middle
        else:
            high = middle
    return low


def after_chunk(limits: Limits, usage: int) -> AfterChunk:
    """G3: over the abort limit the engine reclaims and re-checks; over soft only logs."""
    if limits.abort_limit > 0 and usage > limits.abort_limit:
        return "over_abort"
    if limits.soft_limit > 0 and usage > limits.soft_limit:
        return "over_soft"
    return "ok"


def rejection_message(estimated: int, limit: int, binding: str, *, what: str = "prompt",
                      during: str = "prefill") -> str:
    """The 400 `prefill_memory_exceeded` text: numbers plus the remedy that fits (C6);
    `what` and `during` name the work (an embedding batch says so)."""
    from shared.sizes import format_size

    if binding == DEVICE:
        return (f"{what} needs about {format_size(estimated)} of device memory during {during} but the "
                f"device pool's limit is {format_size(limit)} (binding: device); use a shorter {what} or a "
                f"smaller model, or free device memory (other models, other processes on the GPU)")
    remedy = {
        "dynamic": "close other applications to free memory",
        "gpu_cap": "raise the GPU memory cap (iogpu.wired_limit_mb)",
    }.get(binding, f"use a shorter {what}, a smaller model or a lower tier")
    return (
        f"{what} needs about {format_size(estimated)} during {during} but the limit is "
        f"{format_size(limit)} (binding: {binding or 'static'}); {remedy}"
    )
