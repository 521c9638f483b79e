"""GGUF block decoding (modelfiles/gguf_tensors.py) against ggml's own definitions.

The references below are line-by-line transcriptions of ggml-quants.c's
`dequantize_row_*` (scalar loops over one block); the module under test is
vectorized over blocks. Where MLX decodes a type correctly (Q4_0, Q4_1, Q8_0,
Q6_K), the module is also held to `mx.load` on a GGUF written here.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from modelfiles.gguf_tensors import affine_triple, check_supported, plain_or_dequantized
from shared.gguf import GGML_TYPES, GGUFError, TensorInfo, read_header

TYPE_ID = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}


def h(raw) -> float:
    return float(np.frombuffer(bytes(raw), "<f2")[0])


def ref_q4_0(b):
    d, qs = h(b[0:2]), b[2:18]
    return [((qs[j] & 0xF) - 8) * d for j in range(16)] + [((qs[j] >> 4) - 8) * d for j in range(16)]


def ref_q4_1(b):
    d, m, qs = h(b[0:2]), h(b[2:4]), b[4:20]
    return [(qs[j] & 0xF) * d + m for j in range(16)] + [(qs[j] >> 4) * d + m for j in range(16)]


def ref_q8_0(b):
    d = h(b[0:2])
    return [int(np.int8(np.uint8(q))) * d for q in b[2:34]]


def ref_q5(b, with_min):
    d = h(b[0:2])
    m = h(b[2:4]) if with_min else 0.0
    at = 4 if with_min else 2
    qh = struct.unpack("<I", bytes(b[at:at + 4]))[0]
    qs = b[at + 4:at + 20]
    lo, hi = [], []
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        x0, x1 = (qs[j] & 0xF) | xh0, (qs[j] >> 4) | xh1
        if not with_min:
            x0, x1 = x0 - 16, x1 - 16
        lo.append(x0 * d + m)
        hi.append(x1 * d + m)
    return lo + hi


def scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q45_k(b, five):
    d, dmin, scales = h(b[0:2]), h(b[2:4]), b[4:16]
    qh = b[16:48] if five else None
    ql = b[48:176] if five else b[16:144]
    y, q, is_, u1, u2 = [], 0, 0, 1, 2
    for _ in range(0, 256, 64):
        sc, m = scale_min_k4(is_, scales)
        d1, m1 = d * sc, dmin * m
        sc, m = scale_min_k4(is_ + 1, scales)
        d2, m2 = d * sc, dmin * m
        for lane in range(32):
            extra = (16 if qh[lane] & u1 else 0) if five else 0
            y.append(d1 * ((ql[q + lane] & 0xF) + extra) - m1)
        for lane in range(32):
            extra = (16 if qh[lane] & u2 else 0) if five else 0
            y.append(d2 * ((ql[q + lane] >> 4) + extra) - m2)
        q, is_, u1, u2 = q + 32, is_ + 2, u1 << 2, u2 << 2
    return y


def ref_q6_k(b):
    ql, qh = b[0:128], b[128:192]
    sc = [int(np.int8(np.uint8(s))) for s in b[192:208]]
    d = h(b[208:210])
    y = [0.0] * 256
    for n in range(2):
        for lane in range(32):
            is_ = lane // 16
            q1 = ((ql[64 * n + lane] & 0xF) | (((qh[32 * n + lane] >> 0) & 3) << 4)) - 32
            q2 = ((ql[64 * n + lane + 32] & 0xF) | (((qh[32 * n + lane] >> 2) & 3) << 4)) - 32
            q3 = ((ql[64 * n + lane] >> 4) | (((qh[32 * n + lane] >> 4) & 3) << 4)) - 32
            q4 = ((ql[64 * n + lane + 32] >> 4) | (((qh[32 * n + lane] >> 6) & 3) << 4)) - 32
            base, s = 128 * n, 8 * n
            y[base + lane] = d * sc[s + is_] * q1
            y[base + lane + 32] = d * sc[s + is_ + 2] * q2
            y[base + lane + 64] = d * sc[s + is_ + 4] * q3
            y[base + lane + 96] = d * sc[s + is_ + 6] * q4
    return y


REFERENCES = {
    "Q4_0": ref_q4_0, "Q4_1": ref_q4_1, "Q8_0": ref_q8_0,
    "Q5_0": lambda b: ref_q5(b, False), "Q5_1": lambda b: ref_q5(b, True),
    "Q4_K": lambda b: ref_q45_k(b, False), "Q5_K": lambda b: ref_q45_k(b, True), "Q6_K": ref_q6_k,
}
# where each type keeps its float16 fields (scale, min), so random bytes there are made sane
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, count: int, seed: int = 0) -> np.ndarray:
    _, _, width = GGML_TYPES[TYPE_ID[type_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, width), dtype=np.uint8)
    for at in HALF_FIELDS[type_name]:
        blocks[:, at:at + 2] = rng.uniform(0.001, 0.02, count).astype("<f2").view(np.uint8).reshape(count, 2)
    return blocks


def tensor_of(type_name: str, blocks: np.ndarray, name: str = "w") -> TensorInfo:
    _, per_block, _ = GGML_TYPES[TYPE_ID[type_name]]
    cols = 256 if per_block == 256 else 64
    return TensorInfo(name, (cols, blocks.size // GGML_TYPES[TYPE_ID[type_name]][2] * per_block // cols), type_name)


def decoded(type_name: str, blocks: np.ndarray) -> np.ndarray:
    tensor = tensor_of(type_name, blocks)
    raw = blocks.reshape(-1)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        weight, scales, biases, bits = affine_triple(tensor, raw)
        per_word = 32 // bits
        codes = (weight[..., None] >> (np.arange(per_word, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
        codes = codes.reshape(weight.shape[0], -1, 32).astype(np.float32)
        values = codes * scales[..., None].astype(np.float32) + biases[..., None].astype(np.float32)
        return values.reshape(-1)
    return plain_or_dequantized(tensor, raw).astype(np.float32).reshape(-1)


@pytest.mark.parametrize("type_name", sorted(REFERENCES))
def test_blocks_decode_as_ggml_defines_them(type_name):
    blocks = random_blocks(type_name, 8)
    expected = np.array([v for block in blocks.tolist() for v in REFERENCES[type_name](block)], np.float32)
    got = decoded(type_name, blocks)
    tolerance = 2e-3 * max(1.0, float(np.abs(expected).max()))  # float16 rounding of the results
    np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0)


def write_raw_gguf(path, type_name: str, blocks: np.ndarray) -> TensorInfo:
    """A one-tensor GGUF with these raw blocks (what llama.cpp would have written)."""
    tensor = tensor_of(type_name, blocks)
    text = lambda s: struct.pack("<Q", len(s.encode())) + s.encode()
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    head += text("general.architecture") + struct.pack("<I", 8) + text("llama")
    head += text("w") + struct.pack("<I", 2) + struct.pack("<QQ", *tensor.shape)
    head += struct.pack("<IQ", TYPE_ID[type_name], 0)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + blocks.tobytes())
    return read_header(path).tensors[0]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_kept_quantized_triples_are_what_mx_load_returns(tmp_path, type_name):
    import mlx.core as mx

    blocks = random_blocks(type_name, 16, seed=3)
    tensor = write_raw_gguf(tmp_path / "t.gguf", type_name, blocks)
    loaded = mx.load(str(tmp_path / "t.gguf"))
    weight, scales, biases, _ = affine_triple(tensor, np.fromfile(tmp_path / "t.gguf", np.uint8)[tensor.offset:])
    assert np.array_equal(weight, np.array(loaded["w"]))
    assert np.array_equal(scales, np.array(loaded["w.scales"]))
    assert np.array_equal(biases, np.array(loaded["w.biases"]))


def test_q6_k_is_what_mx_load_returns(tmp_path):
    """An independent decoder agrees where MLX's gguflib is right (it is not for Q4_K)."""
    import mlx.core as mx

    blocks = random_blocks("Q6_K", 4, seed=4)
    tensor = write_raw_gguf(tmp_path / "t.gguf", "Q6_K", blocks)
    ours = plain_or_dequantized(tensor, np.fromfile(tmp_path / "t.gguf", np.uint8)[tensor.offset:])
    assert np.array_equal(ours, np.array(mx.load(str(tmp_path / "t.gguf"))["w"]))


def test_an_unreadable_type_is_refused_naming_the_tensor_and_type():
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_down\.weight' has type IQ2_XS"):
        check_supported([TensorInfo("blk.0.ffn_down.weight", (256, 4), "IQ2_XS")])
