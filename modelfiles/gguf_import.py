"""Turn a GGUF file into an MLX model folder that `mlx_lm.load(DIR)` loads.

`python -m modelfiles.gguf_import FILE.gguf DIR [--force] [--json]`

It builds MLX arrays and writes them with MLX (imported inside the functions
that do), and the supervisor never imports MLX: the supervisor runs this module as
a child process (`import-gguf`, and a `[[models]] path` ending in `.gguf`)
and reads its progress, one JSON line a step (`shared.gguf.ImportLine`),
from its stdout when `--json` is given.

What it handles:
  * the tensors are read from the file's blocks by `modelfiles.gguf_tensors`
    (not `mx.load`, whose Q4_K is wrong: see there); Q4_0, Q4_1 and Q8_0
    stay quantized as MLX affine triples (group 32), the K-quants and Q5_0/
    Q5_1 are dequantized to float16, and a note says which and how big;
  * llama.cpp stores the q and k projections' rows permuted for its rotary
    layout (`convert_hf_to_gguf.py` `permute`); the rows are put back, for
    the packed weights and their scales and biases alike (quantization runs
    along the input dimension, so a row permutation keeps it intact);
  * the tokenizer (GPT-2 style byte-level BPE) and the chat template are
    built from the file's own metadata, so nothing is downloaded;
  * anything it cannot carry over is a `GGUFError` naming the field or tensor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from modelfiles.gguf_tensors import (
    KEPT_QUANTIZED,
    affine_triple,
    check_supported,
    plain_or_dequantized,
)
from modelfiles.staging import staged_model_dir
from shared.gguf import (
    MLX_GROUP_SIZE,
    REQUANTIZE_BITS,
    REQUANTIZE_GROUP,
    GGUFError,
    GGUFHeader,
    ImportDone,
    ImportFailed,
    ImportLine,
    ImportNote,
    ImportProgress,
    TensorInfo,
    read_header,
)
from shared.sizes import format_size

ROPE_FREQS = "rope_freqs.weight"
SHARD_BYTES = 2 * 1024**3
Emit = Callable[[ImportLine], None]

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)$")
_PARTS = ("weight", "scales", "biases", "bias")


def mlx_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (unknown: GGUFError)."""
    base, _, part = gguf_name.rpartition(".")
    if part not in _PARTS:
        raise GGUFError(f"tensor {gguf_name!r} is not supported (unexpected suffix {part!r})")
    if base in _TOP_TENSORS:
        return f"{_TOP_TENSORS[base]}.{part}"
    match = _LAYER_RE.match(base)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{part}"
    raise GGUFError(f"tensor {gguf_name!r} is not supported by the llama importer")


def unpermute_rows(array, n_head: int):
    """Undo llama.cpp's rotary row permutation (per head: halves interleaved back to blocks)."""
    rows = array.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot undo the rotary permutation: {rows} rows for {n_head} heads")
    shape = array.shape
    return array.reshape(n_head, rows // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


# --------------------------------------------------------------------------- config


def _int(header: GGUFHeader, key: str, default: int | None = None) -> int:
    """A numeric metadata value as an int; `default` when the key is absent (None: it must exist).

    Why a helper: metadata values are `object` until checked, and a value of
    the wrong type is a GGUFError naming its key rather than a bare TypeError.
    """
    if default is not None and key not in header.metadata:
        return default
    return int(header.field(key, (int, float)))


def _float(header: GGUFHeader, key: str, default: float) -> float:
    """A numeric metadata value as a float, `default` when the key is absent."""
    if key not in header.metadata:
        return default
    return float(header.field(key, (int, float)))


class Architecture(msgspec.Struct, frozen=True):
    """How one GGUF architecture maps onto an mlx_lm model."""

    model_type: str
    hf_class: str
    rope_rows_permuted: bool  # llama.cpp's converter permutes q/k rows for this architecture


ARCHITECTURES = {
    "llama": Architecture("llama", "LlamaForCausalLM", rope_rows_permuted=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", rope_rows_permuted=False),
}


def architecture(header: GGUFHeader) -> tuple[str, Architecture]:
    arch = header.field("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"general.architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return arch, ARCHITECTURES[arch]


def model_config(header: GGUFHeader, rope_freqs=None) -> dict:
    """config.json for mlx_lm from the `<arch>.*` metadata (`rope_freqs`: that tensor's values)."""
    arch, spec = architecture(header)
    meta = header.metadata
    hidden = _int(header, f"{arch}.embedding_length")
    heads = _int(header, f"{arch}.attention.head_count")
    kv_heads = _int(header, f"{arch}.attention.head_count_kv", heads)
    head_dim = _int(header, f"{arch}.attention.key_length", hidden // heads)
    rope_dims = _int(header, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count {rope_dims} differs from the head size {head_dim} "
                        "(partial rotary embeddings are not supported)")
    names = {t.name for t in header.tensors}
    if "blk.0.ffn_gate_inp.weight" in names or f"{arch}.expert_count" in meta:
        raise GGUFError(f"{arch}.expert_count: mixture-of-experts files are not supported")
    vocab = len(header.field("tokenizer.ggml.tokens", list))
    rope_theta = _float(header, f"{arch}.rope.freq_base", 10000.0)
    config: dict[str, object] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _int(header, f"{arch}.block_count"),
        "intermediate_size": _int(header, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": _int(header, f"{arch}.vocab_size", vocab),
        "rms_norm_eps": _float(header, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": rope_theta,
        "max_position_embeddings": _int(header, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    config.update(_rope_scaling(header, arch))
    if rope_freqs is not None:
        config["rope_scaling"] = llama3_rope_scaling(rope_freqs, rope_theta, head_dim)
    if any(t.stays_quantized for t in header.tensors):
        # mlx_lm reads each layer's bits from its own arrays; this is the default.
        config["quantization"] = {"group_size": MLX_GROUP_SIZE, "bits": 4, "mode": "affine"}
    return config


def _rope_scaling(header: GGUFHeader, arch: str) -> dict:
    kind = header.metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return {}
    if kind == "linear":
        factor = float(header.field(f"{arch}.rope.scaling.factor", (int, float)))
        return {"rope_scaling": {"type": "linear", "factor": factor}}
    raise GGUFError(f"{arch}.rope.scaling.type {kind!r} is not supported (none and linear are)")


def llama3_factors(base: float, head_dim: int, factor: float, low: float, high: float, original: int):
    """Per-frequency divisors as llama.cpp's converter writes them to `rope_freqs.weight`."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def llama3_rope_scaling(rope_freqs, base: float, head_dim: int) -> dict:
    """Llama 3.1+ `rope_freqs.weight` back to mlx_lm's `rope_type: llama3` parameters.

    The file keeps only the per-frequency factors; the parameters that made
    them are found among the published ones and must reproduce every factor.
    """
    values = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor = float(values.max())
    if values.size != head_dim // 2:
        raise GGUFError(f"tensor 'rope_freqs.weight' has {values.size} values for head size {head_dim}")
    for original in (8192, 4096, 2048, 16384, 32768, 131072):
        for low in (1.0, 2.0):
            for high in (4.0, 2.0, 8.0):
                if high > low and np.allclose(llama3_factors(base, head_dim, factor, low, high, original), values, rtol=1e-4):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": original}
    raise GGUFError("tensor 'rope_freqs.weight' does not match llama3 rope scaling for any known parameters")


# --------------------------------------------------------------------------- weights


def _rope_freqs(header: GGUFHeader, src: Path):
    tensor = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    raw = np.fromfile(src, dtype=np.uint8, count=tensor.file_bytes, offset=tensor.offset)
    return plain_or_dequantized(tensor, raw)


def _requantize(values: np.ndarray, bits: int) -> tuple:
    import mlx.core as mx

    weight, scales, biases = mx.quantize(mx.array(values).astype(mx.float16), group_size=REQUANTIZE_GROUP,
                                         bits=bits)
    return np.array(weight), np.array(scales), np.array(biases)


def _arrays_of(tensor: TensorInfo, raw: np.ndarray, heads: dict[str, int],
               requantize: int = 0) -> dict[str, np.ndarray]:
    """One GGUF tensor as the MLX llama arrays it becomes, q/k rows put back in order."""
    target = mlx_name(tensor.name)
    base = target.removesuffix(".weight")
    if tensor.type_name in KEPT_QUANTIZED:
        weight, scales, biases, _bits = affine_triple(tensor, raw)
        arrays = {target: weight, f"{base}.scales": scales, f"{base}.biases": biases}
    elif tensor.requantized(requantize):
        weight, scales, biases = _requantize(plain_or_dequantized(tensor, raw), requantize)
        arrays = {target: weight, f"{base}.scales": scales, f"{base}.biases": biases}
    else:
        arrays = {target: plain_or_dequantized(tensor, raw)}
    kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else ""
    if kind in heads:
        arrays = {name: unpermute_rows(array, heads[kind]) for name, array in arrays.items()}
    return arrays


def _plan_shards(tensors: list[TensorInfo], requantize: int) -> list[list[TensorInfo]]:
    """Tensors in file order, cut into shards of at most SHARD_BYTES (sizes known from the header)."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor.imported_bytes(requantize)
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def _convert_and_write(header: GGUFHeader, src: Path, out: Path, emit: Emit, requantize: int = 0) -> int:
    """Read every tensor from the file's blocks (`modelfiles.gguf_tensors`) and write the shards.

    One shard is held at a time, so a large file is imported in about
    SHARD_BYTES of memory (plus the page cache of the mapped file).
    """
    import mlx.core as mx

    arch, spec = architecture(header)
    heads_q = _int(header, f"{arch}.attention.head_count")
    heads = {"attn_q": heads_q,
             "attn_k": _int(header, f"{arch}.attention.head_count_kv", heads_q)}
    if not spec.rope_rows_permuted:
        heads = {}
    data = np.memmap(src, dtype=np.uint8, mode="r")
    tensors = [t for t in header.tensors if t.name != ROPE_FREQS]  # rope_freqs went into config.json
    shards = _plan_shards(tensors, requantize)
    total, done, written = header.imported_bytes(requantize), 0, 0
    for index, shard in enumerate(shards, 1):
        arrays = {}
        for tensor in shard:
            raw = data[tensor.offset:tensor.offset + tensor.file_bytes]
            if raw.size < tensor.file_bytes:
                raise GGUFError(f"tensor {tensor.name!r}: the file ends inside its data (an incomplete copy?)")
            for name, array in _arrays_of(tensor, raw, heads, requantize).items():
                arrays[name] = mx.array(np.ascontiguousarray(array))
            done += tensor.imported_bytes(requantize)
            emit(ImportProgress(phase="convert", done=done, total=total))
        file = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / file), arrays, metadata={"format": "mlx"})
        written += sum(a.nbytes for a in arrays.values())
        emit(ImportProgress(phase="write", done=written, total=total))
    return written


def _dequantized_note(header: GGUFHeader, requantize: int = 0) -> ImportNote | None:
    lost = [t for t in header.tensors if t.dequantized]
    if not lost:
        return None
    kinds = sorted({t.type_name for t in lost})
    before = sum(t.file_bytes for t in lost)
    after = sum(t.imported_bytes(requantize) for t in lost)
    how = (f"requantized to {requantize}-bit affine (group {REQUANTIZE_GROUP})" if requantize else
           "dequantized to float16 (only Q4_0, Q4_1 and Q8_0 map onto MLX's quantization; "
           "--requantize 4|8 would quantize them again)")
    return ImportNote(
        f"{len(lost)} tensors of type {', '.join(kinds)} are {how}: {format_size(before)} in the file become "
        f"{format_size(after)}; the whole model takes {format_size(header.imported_bytes(requantize))}"
    )


# --------------------------------------------------------------------------- the import


def import_gguf(src: str | Path, dest: str | Path, emit: Emit = lambda line: None,
                *, force: bool = False, requantize: int = 0) -> ImportDone:
    """Write the MLX folder for `src` into `dest`; built aside and moved in at the end."""
    from modelfiles.gguf_tokenizer import write_tokenizer

    started = time.monotonic()
    src, dest = Path(src), Path(dest)
    header = read_header(src)
    config = model_config(header, _rope_freqs(header, src))
    check_supported(header.tensors)
    if requantize not in (0, *REQUANTIZE_BITS):
        raise GGUFError(f"requantize must be one of {REQUANTIZE_BITS} (or 0), got {requantize}")
    if requantize and any(t.requantized(requantize) for t in header.tensors):
        config["quantization"] = {"group_size": REQUANTIZE_GROUP, "bits": requantize, "mode": "affine"}
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not force)):
        raise GGUFError(f"{dest} exists and is not an empty directory (use --force to overwrite)")
    note = _dequantized_note(header, requantize)
    if note is not None:
        emit(note)
    with staged_model_dir(dest) as staging:
        eos = write_tokenizer(header, staging)
        config["eos_token_id"] = eos
        written = _convert_and_write(header, src, staging, emit, requantize)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
    return ImportDone(
        out_dir=str(dest), bytes_written=written,
        quantized_tensors=sum(t.stays_quantized for t in header.tensors),
        dequantized_tensors=sum(t.dequantized and not t.requantized(requantize) for t in header.tensors),
        requantized_tensors=sum(t.requantized(requantize) for t in header.tensors),
        seconds=time.monotonic() - started,
    )


def _printer(as_json: bool) -> Emit:
    encoder = msgspec.json.Encoder()

    def emit(line: ImportLine) -> None:
        if as_json:
            sys.stdout.buffer.write(encoder.encode(line) + b"\n")
            sys.stdout.flush()
        elif isinstance(line, ImportNote):
            print(f"note: {line.text}", file=sys.stderr)

    return emit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modelfiles.gguf_import",
                                     description="Write an MLX model folder from a GGUF file.")
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("dir", help="the folder to write")
    parser.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    parser.add_argument("--json", action="store_true", help="progress as JSON lines on stdout")
    parser.add_argument("--requantize", type=int, choices=REQUANTIZE_BITS, default=0, metavar="BITS",
                        help="quantize every matrix not kept quantized (4 or 8 bits, affine, group 64)")
    args = parser.parse_args(argv)
    emit = _printer(args.json)
    try:
        done = import_gguf(args.gguf, args.dir, emit, force=args.force, requantize=args.requantize)
    except (GGUFError, OSError) as exc:
        emit(ImportFailed(error=str(exc)))
        if not args.json:
            print(f"import-gguf: error: {exc}", file=sys.stderr)
        return 2
    emit(done)
    if not args.json:
        print(f"wrote {done.out_dir}: {format_size(done.bytes_written)} of weights in {done.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
