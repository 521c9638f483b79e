"""Generate small local llama models that `mlx_lm.load(DIR)` loads like any other.

Why this exists: memvisor must work on a fresh machine with no download, and
its tests and benchmarks need real models of a chosen size. The generator
writes random weights (seeded, so the same seed gives the same bytes), a BPE
tokenizer trained offline on an embedded corpus plus the docstrings of
Python's own standard library, and a ChatML-style chat template.

It deliberately imports neither MLX nor mlx_lm: the supervisor (which never
imports MLX, see docs/architecture.md) builds the demo models on first run through this
module. Weights are produced with numpy and streamed tensor by tensor into a
safetensors file, so a ~100M-parameter model never needs more than one tensor
in memory at a time.

Dims rule (documented contract of `choose_dims`):
  * head_dim is 64; hidden H is a multiple of 64; heads = H / 64; key/value
    heads = heads / 2 when heads is even (grouped-query attention), else heads;
  * layers default to max(1, H // 64) (H=256 -> 4 layers, H=768 -> 12);
  * embeddings are tied (no separate lm_head), vocab = the trained tokenizer's;
  * H is the largest multiple of 64 whose default model (intermediate
    ~ 8/3 H) still fits in the requested parameter budget; then the layer count
    is raised as far as the budget allows, and the MLP intermediate size (a
    multiple of 16) absorbs the rest, so the weights land within about 1% of
    the requested size;
  * parameters are float16 by default (bfloat16 and float32 on request: MLX's
    CPU backend runs float32 several times faster than either 16-bit type);
  * `bits=4` or `8` writes the matrices (embedding included) quantized the way
    `mlx_lm.convert -q` does: affine, group size 64, packed uint32 weights with
    scales and biases in the model dtype, `"quantization"` in config.json; the
    MLP width is then a multiple of the group size, and the size budget counts
    the packed bytes. Norms stay in the model dtype.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import sysconfig
from pathlib import Path
from typing import Callable, Iterator, Sequence

import msgspec
import numpy as np

from modelfiles.staging import staged_model_dir
from shared.sizes import MiB, format_size

DTYPES = {"float16": ("F16", 2), "bfloat16": ("BF16", 2), "float32": ("F32", 4)}
DEFAULT_DTYPE = "float16"
QUANT_BITS = (4, 8)
QUANT_GROUP = 64
HEAD_DIM = 64
VOCAB_TARGET = 4096
CORPUS_BUDGET_CHARS = 1_200_000
MIN_INTERMEDIATE = 16
MAX_HIDDEN = 8192
INIT_STD = 0.02
CHUNK_ELEMENTS = 1 << 22  # numbers drawn per slice while streaming a tensor

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
# Fill-in-the-middle tokens as StarCoder and SmolLM spell them (make_model's extra_special)
FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")

# Tools in the Hermes/Qwen style: listed in a system turn, called as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, which is what the
# front door parses. Without tools the rendering is the plain ChatML of before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nYou can call these tools. To call one, answer with "
    "<tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

Progress = Callable[[int, int], None]

# A little English of our own, so the tokenizer sees ordinary prose and chat
# words even where the stdlib docstrings are terse.
_EMBEDDED_CORPUS = """\
The quick brown fox jumps over the lazy dog. A memory guard watches how much
memory each model uses and steps in before the machine runs out. When a model is
idle for a long time it is unloaded, and when a new request arrives the model is
loaded again. Hello! How are you today? I am fine, thank you. What is the weather
like? It is sunny and warm, with a light breeze from the sea. Please tell me a
short story about a cat who learned to read. Once upon a time there was a small
cat named Ada. She lived in a library and every night she read one page of a new
book. The user asked a question and the assistant answered it in a friendly way.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 42. Lists, tables, code,
and plain sentences all appear in text; a tokenizer must handle them all.
"""


class ModelGenError(ValueError):
    """A request the generator cannot honour; the message says why."""


class Dims(msgspec.Struct, frozen=True):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str = DEFAULT_DTYPE
    bits: int = 0  # 0: not quantized; 4 or 8: affine, group QUANT_GROUP

    @property
    def param_count(self) -> int:
        return _param_count(
            self.vocab_size, self.hidden_size, self.num_hidden_layers,
            self.intermediate_size, self.num_key_value_heads,
        )

    @property
    def weight_bytes(self) -> int:
        """Exact bytes of tensor data the safetensors file holds."""
        return sum(entry.nbytes for entry in _file_entries(self))


def _kv_heads(hidden: int) -> int:
    heads = hidden // HEAD_DIM
    return heads // 2 if heads % 2 == 0 else heads


def _layer_params(hidden: int, intermediate: int, kv_heads: int) -> int:
    kv_dim = kv_heads * HEAD_DIM
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    return attention + 3 * hidden * intermediate + 2 * hidden


def _param_count(vocab: int, hidden: int, layers: int, intermediate: int, kv_heads: int) -> int:
    return vocab * hidden + hidden + layers * _layer_params(hidden, intermediate, kv_heads)


def _default_intermediate(hidden: int) -> int:
    return max(MIN_INTERMEDIATE, (8 * hidden // 3) // 16 * 16)


def _dtype_width(dtype: str) -> int:
    if dtype not in DTYPES:
        raise ModelGenError(f"unknown dtype {dtype!r} (use one of {', '.join(DTYPES)})")
    return DTYPES[dtype][1]


def _bytes_per_param(dtype: str, bits: int) -> float:
    """Storage per parameter: the dtype's width, or packed bits plus scale and bias per group."""
    if bits == 0:
        return float(_dtype_width(dtype))
    if bits not in QUANT_BITS:
        raise ModelGenError(f"bits must be one of {', '.join(map(str, QUANT_BITS))} (or 0), got {bits}")
    return bits / 8 + 2 * _dtype_width(dtype) / QUANT_GROUP


def smallest_weight_bytes(vocab_size: int, dtype: str = DEFAULT_DTYPE, bits: int = 0) -> int:
    """The smallest model the dims rule can build for this vocab."""
    smallest = MIN_INTERMEDIATE if bits == 0 else QUANT_GROUP
    return int(_param_count(vocab_size, HEAD_DIM, 1, smallest, 1) * _bytes_per_param(dtype, bits))


def choose_dims(size_bytes: int, vocab_size: int, dtype: str = DEFAULT_DTYPE, bits: int = 0) -> Dims:
    """Pick llama dims whose weights come to about `size_bytes` (see module doc)."""
    width = _bytes_per_param(dtype, bits)
    floor = smallest_weight_bytes(vocab_size, dtype, bits)
    if size_bytes < floor:
        raise ModelGenError(
            f"size {format_size(size_bytes)} is too small for a model: the smallest one "
            f"(vocab {vocab_size}, hidden {HEAD_DIM}, 1 layer) needs {format_size(floor)}"
        )
    budget = int(size_bytes / width)
    step = 16 if bits == 0 else QUANT_GROUP  # a quantized down_proj's input splits into groups
    hidden = HEAD_DIM
    for candidate in range(HEAD_DIM, MAX_HIDDEN + 1, HEAD_DIM):
        layers = max(1, candidate // HEAD_DIM)
        cost = _param_count(vocab_size, candidate, layers, _default_intermediate(candidate),
                            _kv_heads(candidate))
        if cost > budget:
            break
        hidden = candidate
    kv_heads = _kv_heads(hidden)
    fixed = vocab_size * hidden + hidden
    per_layer = _layer_params(hidden, _default_intermediate(hidden), kv_heads)
    layers = max(1, (budget - fixed) // per_layer)
    # The MLP width absorbs what is left so the total lands near the budget.
    per_layer_rest = _layer_params(hidden, 0, kv_heads)
    spare = (budget - fixed) // layers - per_layer_rest
    intermediate = max(max(MIN_INTERMEDIATE, step), spare // (3 * hidden) // step * step)
    return Dims(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=kv_heads,
        dtype=dtype,
        bits=bits,
    )


# --------------------------------------------------------------------------- tokenizer


def corpus_texts(budget_chars: int = CORPUS_BUDGET_CHARS) -> Iterator[str]:
    """Yield offline training text: the embedded prose, then stdlib docstrings.

    Files are read in sorted order and parsed with `ast` (never imported), so
    the corpus is the same on every run of the same Python.
    """
    yield _EMBEDDED_CORPUS
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    used = len(_EMBEDDED_CORPUS)
    for file in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc
                    used += len(doc)
                    if used >= budget_chars:
                        return


@functools.lru_cache(maxsize=2)
def train_tokenizer(vocab_target: int = VOCAB_TARGET):
    """Train a byte-level BPE tokenizer (the kind mlx_lm streams fastest).

    Cached per process: training is most of a small model's build time and
    its result depends on nothing but the corpus. Callers only save it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def _write_tokenizer_files(tokenizer, out: Path, specials: Sequence[str] = tuple(SPECIAL_TOKENS)) -> dict[str, int]:
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[token]): {
                "content": token, "special": True, "lstrip": False, "rstrip": False,
                "normalized": False, "single_word": False,
            }
            for token in specials
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2)
    )
    return ids


# --------------------------------------------------------------------------- weights


def _tensor_shapes(d: Dims) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) for every weight of mlx_lm's llama, in file order."""
    kv_dim = d.num_key_value_heads * HEAD_DIM
    h, i = d.hidden_size, d.intermediate_size
    shapes: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (d.vocab_size, h), False)]
    for n in range(d.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,), True),
            (f"{p}.mlp.down_proj.weight", (h, i), False),
            (f"{p}.mlp.gate_proj.weight", (i, h), False),
            (f"{p}.mlp.up_proj.weight", (i, h), False),
            (f"{p}.post_attention_layernorm.weight", (h,), True),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, h), False),
            (f"{p}.self_attn.o_proj.weight", (h, h), False),
            (f"{p}.self_attn.q_proj.weight", (h, h), False),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, h), False),
        ]
    shapes.append(("model.norm.weight", (h,), True))
    return shapes


class _Entry(msgspec.Struct, frozen=True):
    """One tensor as stored: a plain matrix or norm, or one part of a quantized matrix."""

    name: str
    shape: tuple[int, ...]
    code: str    # safetensors dtype
    width: int   # bytes per stored element
    kind: str    # norm | normal | packed | scales | biases

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.width


def _file_entries(dims: Dims) -> list[_Entry]:
    """Every tensor the safetensors file holds, in file order (quantized ones as three)."""
    code, width = DTYPES[dims.dtype]
    entries = []
    for name, shape, is_norm in _tensor_shapes(dims):
        if is_norm:
            entries.append(_Entry(name, shape, code, width, "norm"))
        elif dims.bits == 0:
            entries.append(_Entry(name, shape, code, width, "normal"))
        else:
            rows, cols = shape
            base = name.removesuffix(".weight")
            groups = (rows, cols // QUANT_GROUP)
            entries += [
                _Entry(f"{base}.weight", (rows, cols * dims.bits // 32), "U32", 4, "packed"),
                _Entry(f"{base}.scales", groups, code, width, "scales"),
                _Entry(f"{base}.biases", groups, code, width, "biases"),
            ]
    return entries


def _safetensors_header(entries: list[_Entry]) -> bytes:
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {"dtype": entry.code, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data must start 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _encode(block: np.ndarray, dtype: str) -> bytes:
    """Little-endian bytes of float32 `block` in `dtype` (bfloat16 by round-to-nearest-even)."""
    if dtype == "float32":
        return block.astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return block.astype("<f2").tobytes()
    bits = block.astype("<f4", copy=False).view("<u4")
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def _block(entry: _Entry, n: int, rng: np.random.Generator, dims: Dims) -> bytes:
    """`n` elements of `entry`: random codes with one scale and bias give uniform weights of std INIT_STD."""
    if entry.kind == "packed":
        return rng.integers(0, 1 << 32, n, dtype=np.uint32).astype("<u4", copy=False).tobytes()
    if entry.kind == "normal":
        return _encode(rng.standard_normal(n, dtype=np.float32) * np.float32(INIT_STD), dims.dtype)
    half_range = INIT_STD * 3 ** 0.5
    value = {"norm": 1.0, "scales": 2 * half_range / ((1 << max(dims.bits, 1)) - 1),
             "biases": -half_range}[entry.kind]
    return _encode(np.full(n, value, dtype=np.float32), dims.dtype)


def write_weights(path: Path, dims: Dims, seed: int, progress: Progress | None = None) -> int:
    """Stream seeded weights into one safetensors file; return data bytes.

    Norm weights are ones (as a trained model's start); matrices are N(0, 0.02)
    or, quantized, uniform codes of the same spread. One numpy PCG64 stream in
    file order makes the bytes a pure function of (dims, seed).
    """
    entries = _file_entries(dims)
    rng = np.random.Generator(np.random.PCG64(seed))
    total = sum(entry.nbytes for entry in entries)
    done = 0
    with open(path, "wb") as out:
        out.write(_safetensors_header(entries))
        for entry in entries:
            count = int(np.prod(entry.shape))
            for start in range(0, count, CHUNK_ELEMENTS):
                n = min(CHUNK_ELEMENTS, count - start)
                out.write(_block(entry, n, rng, dims))
                done += n * entry.width
                if progress is not None:
                    progress(done, total)
    return done


# --------------------------------------------------------------------------- model


def _model_config(dims: Dims, ids: dict[str, int]) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims.hidden_size,
        "num_hidden_layers": dims.num_hidden_layers,
        "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": HEAD_DIM,
        "vocab_size": dims.vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": dims.dtype,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
    }
    if dims.bits:
        quantization = {"group_size": QUANT_GROUP, "bits": dims.bits, "mode": "affine"}
        config["quantization"] = config["quantization_config"] = quantization
    return config


def check_target_dir(path: Path, force: bool) -> None:
    """Refuse to write into an existing non-empty directory unless forced."""
    if path.exists() and not path.is_dir():
        raise ModelGenError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ModelGenError(f"{path} is not empty (use --force to overwrite the model files in it)")


def make_model(
    path: str | os.PathLike,
    size_bytes: int = 16 * MiB,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    force: bool = False,
    dtype: str = DEFAULT_DTYPE,
    bits: int = 0,
    extra_special: Sequence[str] = (),
) -> Dims:
    """Write a loadable llama model of about `size_bytes` weights into `path`.

    Files are built in a temporary sibling directory and moved in at the end,
    so an interrupted run never leaves a half-written model that looks whole.
    `extra_special` adds special tokens after the trained vocabulary
    (FIM_TOKENS gives a model that can fill in the middle).
    """
    if seed < 0:
        raise ModelGenError(f"seed must be a non-negative integer, got {seed}")
    target = Path(path)
    check_target_dir(target, force)
    _bytes_per_param(dtype, bits)
    tokenizer = train_tokenizer()
    if extra_special:  # on a copy: the trained tokenizer is cached for every model of this process
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer.to_str())
        tokenizer.add_special_tokens(list(extra_special))
    dims = choose_dims(size_bytes, tokenizer.get_vocab_size(), dtype, bits)
    with staged_model_dir(target) as staging:
        ids = _write_tokenizer_files(tokenizer, staging, [*SPECIAL_TOKENS, *extra_special])
        config = _model_config(dims, ids)
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids[BOS], "eos_token_id": config["eos_token_id"],
             "pad_token_id": ids[PAD]}, indent=2))
        write_weights(staging / "model.safetensors", dims, seed, progress)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
    return dims
