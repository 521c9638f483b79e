"""The prefill guard (SPEC G1-G3) for a batch of inputs to embed, as pure arithmetic.

Why its own figures: an embedding model keeps no KV cache, so the prefill
estimate of worker/prefill_guard.py (KV growth plus a chunk's transient) does
not describe it. What a step of an encoder allocates is its activations: for
`rows` inputs padded to `length` tokens, one layer at a time, the token
vectors (hidden states, q/k/v, the attention output, the MLP's intermediate
before and after its activation) and the attention scores, heads x length x
length per row (MLX's CPU attention is not fused). The figure learns a scale
from MLX's peak counter after each step, as G2's running estimate does.

The rules, in prefill_guard's terms and with its limits:
  G1: the next row must fit on its own under the prefill limit (usage + its
      padded cost); if not, ask the supervisor to evict idle models once, then
      refuse the request with `prefill_memory_exceeded` (at once when not even
      stopping every other model would make room).
  G2: a step takes as many rows as fit under the chunk target (padded) and the
      step's token budget (its time bound); a big batch is split over steps,
      never refused for its size alone.
  G3: after a step, over the abort limit: reclaim, then fail what ran.

No MLX, no clock, no I/O: every edge is a table test.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from shared.limits import Limits
from shared.vocab import LimitBinding
from worker.prefill_guard import COST_PAD, chunk_target, prefill_limit


class EmbedCost(msgspec.Struct, frozen=True):
    """Bytes a step allocates above the usage before it, per token and per token pair."""

    per_token: float  # per padded token: the activations of one layer and the pooled copy
    per_pair: float  # per (query, key) pair of one row: attention scores, softmax, mask
    scale: float = 1.0  # measured / modelled, learned (never below 1)
    measured: bool = False


def prior_cost(hidden: int, intermediate: int, heads: int, dtype_bytes: int) -> EmbedCost:
    """The model before any step was measured: hidden states, q/k/v, the attention output
    and the residual (8 x hidden), the MLP's intermediate twice, a float32 copy for
    pooling; scores, their softmax and the additive mask per head."""
    per_token = dtype_bytes * (8 * hidden + 2 * intermediate) + 4 * hidden
    return EmbedCost(per_token=float(per_token), per_pair=float(3 * heads * dtype_bytes))


def step_bytes(cost: EmbedCost, rows: int, length: int, *, scaled: bool = True) -> int:
    """What a step of `rows` inputs padded to `length` tokens adds at its peak."""
    if rows <= 0 or length <= 0:
        return 0
    raw = rows * length * cost.per_token + rows * length * length * cost.per_pair
    return math.ceil(raw * max(1.0, cost.scale) if scaled else raw)


def padded_step_bytes(cost: EmbedCost, rows: int, length: int) -> int:
    """G2's view of a step: the running estimate x COST_PAD."""
    return math.ceil(step_bytes(cost, rows, length) * COST_PAD)


def learn(cost: EmbedCost, measured: int, rows: int, length: int) -> EmbedCost:
    """After a step: the scale jumps up at once to what was measured, and eases down slowly."""
    raw = step_bytes(cost, rows, length, scaled=False)
    if raw <= 0 or measured <= 0:
        return cost
    observed = max(1.0, measured / raw)
    scale = observed if observed > cost.scale or not cost.measured else 0.7 * cost.scale + 0.3 * observed
    return msgspec.structs.replace(cost, scale=max(1.0, scale), measured=True)


class RowVerdict(msgspec.Struct, frozen=True):
    """G1 for the next row to embed: `fits`, `evict` (ask for `need_bytes`), or `reject`."""

    verdict: Literal["fits", "evict", "reject"]
    estimated_bytes: int = 0
    limit_bytes: int = 0
    binding: LimitBinding = ""
    need_bytes: int = 0


def first_row(limits: Limits, usage: int, own_usage: int, cost: EmbedCost, length: int, *,
              retried: bool) -> RowVerdict:
    """G1: can one input of `length` tokens be embedded on top of the group's `usage`?"""
    limit = prefill_limit(limits)
    if limit.bytes == 0:
        return RowVerdict("fits")
    peak = padded_step_bytes(cost, 1, length)
    if usage + peak <= limit.bytes:
        return RowVerdict("fits", usage + peak, limit.bytes, limit.binding)
    if retried or own_usage + peak > limit.bytes:  # evicting every other model would not make room
        return RowVerdict("reject", usage + peak, limit.bytes, limit.binding)
    return RowVerdict("evict", usage + peak, limit.bytes, limit.binding, need_bytes=usage + peak - limit.bytes)


def rows_for_step(limits: Limits, usage: int, cost: EmbedCost, lengths: list[int], token_budget: int) -> int:
    """G2: how many of the waiting rows (in order; `lengths` their token counts) the next
    step takes: at least one (G1 has let it in), then while the rows padded to the
    longest stay within `token_budget` tokens and, padded, under the chunk target."""
    if not lengths:
        return 0
    target = chunk_target(limits).bytes
    longest = lengths[0]
    rows = 1
    for length in lengths[1:]:
        wider = max(longest, length)
        if (rows + 1) * wider > token_budget:
            break
        if target and usage + padded_step_bytes(cost, rows + 1, wider) > target:
            break
        rows, longest = rows + 1, wider
    return rows
