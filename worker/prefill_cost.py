"""What a prompt token costs during prefill: the prior and the running estimate (SPEC G1/G2).

Why a module of its own: the prefill guard (`worker.prefill_guard`) is pure
arithmetic on a `PrefillCost`; where that cost comes from (the model's shape
before anything ran, then what MLX's peak counter says each chunk took) is a
separate question, and keeping it out of the engine lets the engine change
without touching the cost model, and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import msgspec

from shared.modelinfo import AttentionShape, attention_shape
from worker.prefill_guard import PrefillCost, kv_bytes, transient_bytes

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


# Coefficients of the prior, fitted to `scripts/bench_prefill_peak.py`'s figures (see README):
# bytes per hidden unit per chunk token (part of the activations stays float32 whatever the dtype),
ACT_FIXED = 28     # ... independent of the model's dtype
ACT_WIDTH = 16     # ... per byte of the activation dtype
# bytes per chunk token x context token (scores, mask and softmax of MLX's unfused CPU attention),
SCORE_PER_HEAD = 1.0   # ... per head and byte of the dtype
SCORE_FIXED = 1.5      # ... whatever the heads and dtype (the boolean causal mask and its like)
KV_SLACK = 0.8        # footprint beyond MLX's peak per byte of KV before the last chunk (MLX's pool; measured 0-0.9)
UNKNOWN_KV = 64 * 1024      # unknown architecture: a cautious 64 KiB of KV per token ...
UNKNOWN_CHUNK = 64 * 1024   # ... and as much in flight; the first chunk measured corrects it
KV_STEP = 256               # mlx_lm's KVCache grows by this many tokens (read from it when loaded)


def cost_from_shape(shape: AttentionShape, width: int, kv_step: int = KV_STEP) -> PrefillCost:
    """The prior for a standard attention model of this shape (no MLX needed).

    KV bytes are exact (`AttentionShape.kv_bytes_per_token`). The rest is
    what a chunk allocates and frees again, one layer at a time: activations
    in proportion to the hidden size (the MLP's intermediate is freed as it
    is used; the fit did not improve with a term of its own), the attention
    scores in proportion to heads x chunk x context, and a layer's KV copied
    while the cache grows (`context_per_token`).
    """
    kv = shape.kv_bytes_per_token(width)
    hidden, heads = shape.hidden, shape.heads
    if kv <= 0 or hidden <= 0 or heads <= 0:
        return PrefillCost(kv_per_token=float(UNKNOWN_KV), chunk_per_token=float(UNKNOWN_CHUNK),
                           kv_slack=KV_SLACK, kv_step=kv_step)
    return PrefillCost(
        kv_per_token=float(kv),
        chunk_per_token=float(hidden * (ACT_FIXED + ACT_WIDTH * width)),
        score_per_pair=SCORE_PER_HEAD * heads * width + SCORE_FIXED,
        context_per_token=float(kv / shape.layers),
        kv_slack=KV_SLACK,
        kv_step=kv_step,
    )


def cost_from_config(config: Mapping[str, Any], width: int) -> PrefillCost:
    """The prior from a model's config.json, without MLX (the pressure lab asks it in a child process)."""
    return cost_from_shape(attention_shape(config), width)


_SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def prior_cost(model: Any, max_chunk: int = 0) -> PrefillCost:
    """First estimate of a prefill's cost before anything was measured (G1's prior).

    Read from the loaded model's own arguments (what mlx_lm parsed from
    config.json) and its activation width. `max_chunk` is no longer used (the
    scores' cost is now per chunk x context, not per token of a full chunk);
    it stays so callers need not change.
    """
    from mlx_lm.models.cache import KVCache

    args = getattr(model, "args", None)
    fields = {key: getattr(args, key, None) for key in _SHAPE_KEYS}  # mlx_lm's arguments keep config.json's names
    shape = attention_shape(fields, layers=len(getattr(model, "layers", []) or []))
    return cost_from_shape(shape, activation_width(model), kv_step=int(getattr(KVCache, "step", KV_STEP)))


def learn(cost: PrefillCost, grown: int, tokens: int, done: int = 0) -> PrefillCost:
    """The running estimate after a chunk of `tokens` on `done` cached ones grew MLX's peak by `grown`.

    What is learned is a scale on the modelled transient (the KV is exact):
    measured / modelled, never below 1, jumping up at once and decaying
    slowly (G2), so a model the prior under-estimates is corrected by its
    first chunk and one odd chunk does not shrink the next ones. Chunks
    shorter than MIN_LEARN_TOKENS are skipped: their peak is mostly fixed
    per-call buffers, and scaling every later chunk by them would make long
    prompts look far more expensive than they are.
    """
    if tokens < MIN_LEARN_TOKENS:
        return cost
    modelled = transient_bytes(cost, done, tokens, scaled=False)
    if modelled <= 0:
        return cost
    kv_grown = kv_bytes(cost, done + tokens) - kv_bytes(cost, done)  # MLX's peak: no footprint slack
    observed = max(0.0, grown - kv_grown) / modelled
    scale = observed if not cost.measured else max(observed, 0.7 * cost.scale + 0.3 * observed)
    return msgspec.structs.replace(cost, scale=max(1.0, scale), measured=True)
