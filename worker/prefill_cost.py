"""What a prompt token costs during prefill: the prior and the running estimate (SPEC G1/G2).

Why a module of its own: the prefill guard (`worker.prefill_guard`) is pure
arithmetic on a `PrefillCost`; where that cost comes from (the model's shape
before anything ran, then what MLX's peak counter says each chunk took) is a
separate question, and keeping it out of the engine lets the engine change
without touching the cost model, and the other way round.
"""

from __future__ import annotations

from typing import Any, cast

from worker.prefill_guard import PrefillCost

MIN_LEARN_TOKENS = 16  # shorter chunks do not update the per-token cost estimate


def activation_width(model: Any) -> int:
    """Bytes per activation and KV element: the widest floating dtype among the parameters.

    Why not the first parameter's: a quantized model's packed weights are
    uint32 and say nothing about activations; and every layer mixes its
    parameters into the activations, so MLX's type promotion carries the
    widest floating type through (an imported GGUF's float32 norms make a
    float16-scaled model compute, and cache, in float32).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # without `destination`, tree_flatten returns a list of (name, leaf) pairs (its type says list or dict)
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    widths = [v.dtype.size for _, v in parameters
              if mx.issubdtype(v.dtype, mx.floating)]
    return max(widths, default=2)


def prior_cost(model: Any, max_chunk: int) -> PrefillCost:
    """First guess of a prompt token's cost before anything was measured.

    KV bytes are exact for standard attention models (2 x layers x kv heads x
    head dim x dtype width); activations are a rough multiple of the widths,
    replaced by measurements after the first chunk.
    """
    args = getattr(model, "args", None)
    layers = len(getattr(model, "layers", []) or [])
    hidden = getattr(args, "hidden_size", 0) or 0
    heads = getattr(args, "num_attention_heads", 0) or 0
    kv_heads = getattr(args, "num_key_value_heads", 0) or heads
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads else 0)
    inter = getattr(args, "intermediate_size", 0) or 4 * hidden
    width = activation_width(model)
    kv = 2 * layers * kv_heads * head_dim * width
    activations = 4 * (6 * hidden + 3 * inter) + 4 * heads * max_chunk
    if kv == 0:
        kv = 64 * 1024  # unknown architecture: a cautious 64 KiB per token
    return PrefillCost(kv_per_token=float(kv), chunk_per_token=float(kv + activations))


def learn(cost: PrefillCost, grown: int, tokens: int, done: int = 0) -> PrefillCost:
    """Running per-token estimate after a chunk of `tokens` grew MLX's peak by `grown` (G2).

    It jumps up at once and decays slowly. Chunks shorter than
    MIN_LEARN_TOKENS are skipped: their peak is mostly fixed per-call buffers,
    and dividing that by a handful of tokens would make the next long prompt
    look far more expensive than it is. `done` is how many tokens the cache
    held before the chunk ran.
    """
    if tokens < MIN_LEARN_TOKENS:
        return cost
    observed = max(0.0, grown / tokens)
    new = observed if not cost.measured else max(observed, 0.7 * cost.chunk_per_token + 0.3 * observed)
    new = max(new, cost.kv_per_token)
    return PrefillCost(kv_per_token=cost.kv_per_token, chunk_per_token=new, measured=True)
