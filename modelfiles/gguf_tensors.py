"""GGUF tensor data to MLX arrays' bytes, in numpy (ggml's block layouts, `ggml-quants.c`).

Why not `mx.load`: MLX (0.32) reads Q4_0, Q4_1 and Q8_0 right, but hands
other quantized types to gguflib, whose Q4_K dequantization applies each
64-weight pair's first scale and min to both halves (so every Q4_K_M file,
Ollama's default, would load as wrong weights without any error), and which
refuses Q5_K, Q5_0 and Q5_1 outright. Reading the blocks here makes every
type either right or a clear error naming the tensor:

  * Q4_0, Q4_1, Q8_0 become MLX affine quantized triples (packed uint32
    weights, float16 scales and biases, group 32), exactly what `mx.load`
    returns for them (tested against it);
  * Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 are dequantized to float16;
  * F32, F16 and BF16 are kept as they are (BF16 widened to float32, which
    numpy can hold).
"""

from __future__ import annotations

import numpy as np

from shared.gguf import GGML_TYPES, GGUFError, TensorInfo

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields of a (blocks, 2) uint8 view, as float32."""
    return raw.copy().view("<f2").astype(np.float32).reshape(-1)


def _blocks(tensor: TensorInfo, data: np.ndarray) -> np.ndarray:
    _name, per_block, width = GGML_TYPES[_type_id(tensor.type_name)]
    count = tensor.elements // per_block
    return data[: count * width].reshape(count, width)


def _type_id(name: str) -> int:
    return next(i for i, entry in GGML_TYPES.items() if entry[0] == name)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """The 32 4-bit codes of a Q4_0/Q4_1 block: low nibbles first, then high ones."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


# --------------------------------------------------------------------------- kept quantized


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing: element k of each uint32 at bits k*bits (little end first)."""
    per_word = 32 // bits
    words = codes.astype(np.uint32).reshape(-1, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, :]
    return np.bitwise_or.reduce(words << shifts, axis=1)


def affine_triple(tensor: TensorInfo, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_0 / Q4_1 / Q8_0 blocks as (packed weight, scales, biases, bits); rows = outer dims."""
    blocks = _blocks(tensor, data)
    if tensor.type_name == "Q8_0":
        scale = _f16(blocks[:, 0:2])
        codes = blocks[:, 2:34].view(np.int8).astype(np.int16) + 128
        bias, bits = -128.0 * scale, 8
    elif tensor.type_name == "Q4_0":
        scale = _f16(blocks[:, 0:2])
        codes, bias, bits = _nibbles32(blocks[:, 2:18]), -8.0 * scale, 4
    elif tensor.type_name == "Q4_1":
        scale, bias = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        codes, bits = _nibbles32(blocks[:, 4:20]), 4
    else:
        raise GGUFError(f"tensor {tensor.name!r}: {tensor.type_name} is not an affine-quantized type")
    rows = tensor.elements // tensor.shape[0]
    weight = _pack(codes, bits).reshape(rows, -1)
    groups = (rows, tensor.shape[0] // 32)
    return (weight, scale.astype(np.float16).reshape(groups), bias.astype(np.float16).reshape(groups), bits)


# --------------------------------------------------------------------------- dequantized


def _q5_0(blocks: np.ndarray, with_min: bool) -> np.ndarray:
    scale = _f16(blocks[:, 0:2])[:, None]
    start = 4 if with_min else 2
    high = blocks[:, start:start + 4].copy().view("<u4").reshape(-1, 1)
    qs = blocks[:, start + 4:start + 20]
    bit = (high >> np.arange(32, dtype=np.uint32)[None, :]) & 1
    codes = (_nibbles32(qs).astype(np.int32) | (bit.astype(np.int32) << 4))
    if with_min:
        return codes * scale + _f16(blocks[:, 2:4])[:, None]
    return (codes - 16) * scale


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block."""
    s = packed.astype(np.int32)
    scales = np.empty((len(s), 8), np.int32)
    mins = np.empty((len(s), 8), np.int32)
    scales[:, :4], mins[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    scales[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return scales, mins


def _k_quant_45(blocks: np.ndarray, five: bool) -> np.ndarray:
    """Q4_K / Q5_K: 8 sub-blocks of 32; pair p takes the low nibbles of 32 bytes, then the high."""
    d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    qs = blocks[:, 48:176] if five else blocks[:, 16:144]
    qs = qs.reshape(-1, 4, 1, 32)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.int32)  # (B, pair, half, 32)
    if five:
        qh = blocks[:, 16:48].reshape(-1, 1, 1, 32).astype(np.int32)
        shift = np.arange(8, dtype=np.int32).reshape(1, 4, 2, 1)
        codes |= ((qh >> shift) & 1) << 4
    codes = codes.reshape(-1, 8, 32)
    return (d[:, :, None] * scales[:, :, None] * codes - dmin[:, :, None] * mins[:, :, None]).reshape(-1, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: two clusters of 128; low 4 bits from ql, high 2 from qh, a signed scale per 16."""
    ql = blocks[:, 0:128].reshape(-1, 2, 64).astype(np.int32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32).astype(np.int32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(blocks[:, 208:210])[:, None, None]
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)                       # (B, 2, 128)
    high = ((qh >> np.array([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3).reshape(-1, 2, 128)
    codes = (low | (high << 4)) - 32
    return (d * np.repeat(scales, 16, axis=2) * codes).reshape(-1, QK_K)


_DEQUANT = {
    "Q5_0": lambda b: _q5_0(b, with_min=False),
    "Q5_1": lambda b: _q5_0(b, with_min=True),
    "Q4_K": lambda b: _k_quant_45(b, five=False),
    "Q5_K": lambda b: _k_quant_45(b, five=True),
    "Q6_K": _q6_k,
}
DEQUANTIZABLE = frozenset(_DEQUANT)
KEPT_QUANTIZED = frozenset({"Q4_0", "Q4_1", "Q8_0"})
PLAIN = frozenset({"F32", "F16", "BF16"})


def plain_or_dequantized(tensor: TensorInfo, data: np.ndarray) -> np.ndarray:
    """Float values of a non-affine tensor, shaped as MLX orders it (outermost first)."""
    shape = tuple(reversed(tensor.shape))
    n = tensor.elements
    match tensor.type_name:
        case "F32":
            return data[: 4 * n].view("<f4").reshape(shape)
        case "F16":
            return data[: 2 * n].view("<f2").reshape(shape)
        case "BF16":
            return (data[: 2 * n].view("<u2").astype(np.uint32) << 16).view("<f4").reshape(shape)
        case name if name in _DEQUANT:
            return _DEQUANT[name](_blocks(tensor, data)).astype(np.float16).reshape(shape)
        case name:
            raise GGUFError(f"tensor {tensor.name!r} has type {name}, which the importer cannot read "
                            f"(supported: {', '.join(sorted(PLAIN | KEPT_QUANTIZED | DEQUANTIZABLE))})")


def check_supported(tensors) -> None:
    """Refuse, before any work, a file holding a type this module cannot read."""
    for tensor in tensors:
        if tensor.type_name not in PLAIN | KEPT_QUANTIZED | DEQUANTIZABLE:
            plain_or_dequantized(tensor, np.zeros(0, np.uint8))
