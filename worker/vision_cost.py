"""What an image request's vision tower costs in memory, before and after it ran (G1 for images).

The tower (SigLIP in SmolVLM/Idefics3) runs all of a request's tiles in one
batch, every tile at the tower's fixed resolution, so its peak is a cost per
tile times the tiles, whatever the images' own sizes: those decide the tiles
(the processor splits an image by its aspect ratio), not the cost of one.
Measured with `scripts/bench_vision.py` across tiles, image counts and towers
of several shapes, a tile adds, in bytes of the activation dtype `w`:

* `17 x n x d x w`: the residual stream and its copies (layer norms, q/k/v,
  the attention's output, the connector's pixel shuffle) for `n` patches of
  width `d`;
* `h x n^2 x w`: one head's attention scores at a time (MLX's CPU attention is
  not fused);
* `2 x n x i x w`: the MLP's intermediate of width `i` and its activation;
* `3 x side^2 x w`: the tile's pixels, copied into the tower's layout.

The estimate G1 uses is that prior until a tower has run, then the measured
peak per tile (`learn`: it jumps up at once and decays slowly, as the text
cost's running estimate does; worker/prefill_cost.py).
Nothing here imports MLX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

RESIDUAL = 17.0
SCORES = 1.0
MLP = 2.0
PIXELS = 3.0
# Margins for what MLX's peak does not see: freed buffers the allocator keeps while a layer asks for
# buffers of other sizes. In a fresh worker the anonymous memory (what the guard's usage counts) rose
# up to 19 % above MLX's peak over the tower (scripts/bench_vision.py); the fit itself came within -3..+4 %.
PRIOR_PAD = 1.22
LEARN_PAD = 1.20
UNKNOWN_TILE = 64 * 1024 * 1024  # a tower whose config says too little: a cautious 64 MiB a tile


class VisionCost(msgspec.Struct, frozen=True):
    """Bytes a tower adds per tile above the usage before it (`scale` times the prior once measured)."""

    per_tile: float
    scale: float = 1.0
    measured: bool = False


def prior(config: Mapping[str, Any], width: int = 4) -> VisionCost:
    """The prior from a VLM's config.json (its `vision_config`, and the tile side it declares)."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return VisionCost(per_tile=float(UNKNOWN_TILE))
    side, patch = _int(vision, "image_size"), _int(vision, "patch_size")
    d, heads, inner = _int(vision, "hidden_size"), _int(vision, "num_attention_heads"), _int(vision, "intermediate_size")
    if not (side and patch and d and heads):
        return VisionCost(per_tile=float(UNKNOWN_TILE))
    n = (side // patch) ** 2
    inner = inner or 4 * d
    per_tile = (RESIDUAL * n * d + SCORES * heads * n * n + MLP * n * inner + PIXELS * side * side) * width
    return VisionCost(per_tile=per_tile * PRIOR_PAD)


def peak(cost: VisionCost, tiles: int, embed_bytes: int = 0) -> int:
    """G1: the bytes a tower over `tiles` tiles adds at its peak, its output embeddings included."""
    return math.ceil(max(0, tiles) * cost.per_tile * cost.scale) + max(0, embed_bytes)


def learn(cost: VisionCost, grown: int, tiles: int) -> VisionCost:
    """The running estimate after a tower over `tiles` tiles grew MLX's peak by `grown` (its output aside).

    A tower's peak per tile does not depend on the images (every tile has the tower's resolution), so
    what one run measured (with LEARN_PAD for the process footprint's slack over MLX's peak) replaces
    the prior, below it too: a prior that over-estimates would otherwise refuse, or cost someone an
    idle model for, images that fit. Up at once, down slowly (as the text cost)."""
    if tiles <= 0 or cost.per_tile <= 0:
        return cost
    observed = LEARN_PAD * max(0.0, grown) / (tiles * cost.per_tile)
    scale = observed if not cost.measured else max(observed, 0.7 * cost.scale + 0.3 * observed)
    return msgspec.structs.replace(cost, scale=scale, measured=True)


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
