"""What this model's KV looks like, and whether an entry read back from disk is that (SPEC H5.3).

Why: an entry file is input. A wrong-shape entry gave a 500 (`broadcast_shapes`)
to every prompt sharing its prefix, and kept coming back because the worker
that read it wrote it again at its stop; an all-NaN entry turned replies into
`<pad>` and spread the same way. So before an entry enters the memory cache,
its header's arrays must be exactly what this model's cache holds for that
many tokens (names, dtype, every dimension), and once loaded its checksum must
match (worker/kv_files.py) and every float be finite.

The layout is learned from the loaded model itself, not from config.json: one
token through a fresh cache gives every layer's (KV heads, key width) and
(KV heads, value width) and the KV's dtype exactly, whatever the model family
calls them (per-layer head counts, MLA's different key and value widths, an
imported model that computes in float32). The disk tier asks for it the first
time it reads an entry, so a worker that never reads one never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from worker import kv_files
from worker.prompt_cache import QUANT_GROUPS

QUANT_BITS = (4, 8)   # what H6 stores ([guard] cache_quantize_bits)
_PARTS = ("q", "scales", "biases")


class LayerShape(NamedTuple):
    keys: tuple[int, int]     # (KV heads, key width)
    values: tuple[int, int]   # (KV heads, value width)


class KVLayout(NamedTuple):
    """Every layer's KV shape and the KV's dtype, as this model's cache holds them."""

    dtype: str                        # the safetensors code (F16, BF16, F32)
    layers: tuple[LayerShape, ...]

    @classmethod
    def of(cls, caches: Sequence[KVCache]) -> "KVLayout":
        """The layout of filled float caches (batch, heads, tokens, width)."""
        shapes = []
        for c in caches:
            assert c.keys is not None and c.values is not None
            shapes.append(LayerShape((c.keys.shape[1], c.keys.shape[3]), (c.values.shape[1], c.values.shape[3])))
        first = caches[0].keys
        assert first is not None
        return cls(kv_files.dtype_code(first.dtype), tuple(shapes))


def probe(model: Any) -> KVLayout:
    """One token (id 0) through a fresh cache of `model`: the layout its KV really has."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([(c.keys, c.values) for c in caches])
    return KVLayout.of(caches)


def _expected(layout: KVLayout, tokens: int, bits: int, group: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each array's (dtype, shape) in an entry of `tokens` tokens stored at `bits` (0: float)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, layer in enumerate(layout.layers):
        for kind, (heads, width) in (("keys", layer.keys), ("values", layer.values)):
            if not bits:
                out[f"{i}.{kind}"] = (layout.dtype, (1, heads, tokens, width))
                continue
            out[f"{i}.{kind}.q"] = ("U32", (1, heads, tokens, width * bits // 32))
            for part in _PARTS[1:]:
                out[f"{i}.{kind}.{part}"] = (layout.dtype, (1, heads, tokens, width // group))
    return out


def layout_problem(header: kv_files.Header, layout: KVLayout, tokens: int) -> str | None:
    """Why the arrays `header` declares are not this model's KV for `tokens` tokens; None when
    they are, exactly (checked before any data is read)."""
    metadata = header.metadata
    try:
        layers, bits, group = int(metadata["layers"]), int(metadata["bits"]), int(metadata["group_size"])
    except (KeyError, ValueError):
        return "no layers, bits or group_size in its metadata"
    if layers != len(layout.layers):
        return f"{layers} layers, the model has {len(layout.layers)}"
    if bits and (bits not in QUANT_BITS or group not in QUANT_GROUPS
                 or any(width % group for layer in layout.layers for _, width in layer)):
        return f"quantized at {bits} bits in groups of {group}, which this model's KV cannot be"
    expected = _expected(layout, tokens, bits, group)
    if set(header.tensors) != set(expected):
        return f"arrays {sorted(set(header.tensors) ^ set(expected))[:4]} where the model's KV has other names"
    for name, (dtype, shape) in expected.items():
        found = header.tensors[name]
        if (found.dtype, found.shape) != (dtype, shape):
            return f"{name} is {found.dtype} {list(found.shape)}, the model's KV {dtype} {list(shape)}"
    return None


def finite_problem(arrays: dict[str, mx.array]) -> str | None:
    """Why the loaded floats may not be used (a NaN or an infinity among them), or None.

    Read as integers through numpy on the arrays' own buffers, a slice at a time: a float is
    infinite or NaN exactly when its exponent bits are all ones. MLX's `isfinite` on the CPU
    took 2 s for a 128 MiB float16 entry, numpy's 0.14 s, the exponent bits 0.03 s."""
    for array in arrays.values():
        code = kv_files.dtype_code(array.dtype)
        if code in _EXPONENT and not _all_finite(array, *_EXPONENT[code]):
            return "it holds NaN or infinite values"
    return None


_EXPONENT: dict[str, tuple[type[np.unsignedinteger], int]] = {
    "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000)}
_SLICE = 1 << 20   # elements checked at a time: the temporary it needs stays small


def _all_finite(array: mx.array, bits: type[np.unsignedinteger], exponent: int) -> bool:
    flat = kv_files.host_view(array).view(bits).reshape(-1)  # no copy: a loaded array is contiguous
    return all(int((flat[i:i + _SLICE] & exponent).max()) != exponent for i in range(0, flat.size, _SLICE))
