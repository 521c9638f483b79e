"""What a model's small files say about it, for model cards (`/v1/models`, Ollama's
`/api/tags`, `/api/show`), read without MLX.

Why a module of its own: the OpenAI card wants the context length, Ollama's
`/api/show` wants the architecture, the chat template, whether tools and
fill-in-the-middle work, and a parameter size; all of it lives in
`config.json` and `tokenizer_config.json` (or `chat_template.jinja`) beside the
weights. Every read goes through `shared.modelinfo.read_small` (regular files
only, size-capped: a models folder is input) and callers run
`read_facts` off the loop, so a slow disk never stalls a token stream.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from shared import fim
from shared.embedding import EmbeddingSpec, read_embedding_spec
from shared.gguf import GGUFError, read_header
from shared.modelinfo import CONFIG_MAX_BYTES, context_length, read_config_json, read_small
from shared.vision_families import vision_family
from shared.weights import WeightsError, WeightsSummary, summarize_weights, weight_files
from supervisor.http.openai_types import BodyError
from supervisor.wiring.offloop import MODEL_FILES_TIMEOUT, OffLoopTimeout, off_loop

TOKENIZER_MAX_BYTES = 64 * 1024 * 1024  # tokenizer.json: tens of MB for the largest vocabularies
GGUF_SPECIAL_TYPES = (3, 4)  # tokenizer.ggml.token_type: control and user-defined (the added tokens)


class ModelFacts(msgspec.Struct, kw_only=True):
    """The facts of one model path; every field optional ("" / 0 / None: not known)."""

    format: str = "safetensors"  # "safetensors" | "gguf"
    family: str = ""  # config.json model_type, e.g. "llama"
    context_length: int | None = None
    template: str = ""  # the chat template, as the tokenizer config carries it
    has_template: bool = False
    fim: bool = False  # the tokenizer has fill-in-the-middle tokens (shared.fim)
    # MLX's affine quantization "Q4", "Q8" (bits; another mode by its name, "MXFP4"), plain
    # "F16", "BF16", "F32"; a GGUF's file type as llama.cpp names it ("Q4_K_M", "Q8_0")
    quantization_level: str = ""
    bytes_per_parameter: float = 0.0  # from the dtype or quantization bits (0: unknown)
    parameters: int = 0  # counted from the weight files' headers (shared.weights; 0: unknown)
    file_bytes: int = 0  # the weight files' size on disk: a .gguf file's own, a folder's model*.safetensors
    modified: float = 0.0  # mtime of config.json (a .gguf file's own); 0: unknown
    embedding: EmbeddingSpec | None = None  # a sentence-embedding model's facts (None: it generates)
    vision: bool = False  # it reads images (shared/vision_families.py; docs/vision.md)


def digest(model_id: str, path: str) -> str:
    """A stable id for a model entry (Ollama shows one per model): the same id and path
    always give the same digest, another path another."""
    return hashlib.sha256(f"{model_id}\0{path}".encode()).hexdigest()


def read_facts(path: str) -> ModelFacts:
    """What `path` (a model folder, or a .gguf file) says; blocking: run it off the loop."""
    folder = Path(path).expanduser()
    if folder.suffix.lower() == ".gguf":
        return gguf_facts(folder)
    facts = ModelFacts(context_length=context_length(folder))
    try:
        facts.modified = (folder / "config.json").stat().st_mtime
    except OSError:
        pass
    config = read_config_json(folder) or {}
    _dtype_facts(facts, config)
    _weights_facts(facts, folder)
    model_type = config.get("model_type")
    if isinstance(model_type, str):
        facts.family = model_type[:64]
    tok = _read_json(folder / "tokenizer_config.json")
    template = tok.get("chat_template")
    if template is None:
        template = _read_text(folder / "chat_template.jinja")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next((t for t in named.values() if isinstance(t, str)), None)
    if isinstance(template, str) and template:
        facts.template, facts.has_template = template, True
    facts.fim = _has_fim(folder, tok)
    facts.vision = vision_family(config) is not None
    facts.embedding = read_embedding_spec(folder)
    if facts.embedding is not None:  # the longest input it embeds, not its position table
        facts.context_length = facts.embedding.max_tokens
    return facts


def gguf_facts(path: Path) -> ModelFacts:
    """What a GGUF header says (context length, family, template, FIM tokens),
    read once per version of the file (its header holds the whole vocabulary)."""
    try:
        info = path.stat()
    except OSError:
        return ModelFacts(format="gguf")
    facts = msgspec.structs.replace(_gguf_header_facts(str(path), info.st_mtime_ns, info.st_size))
    facts.file_bytes, facts.modified = info.st_size, info.st_mtime
    return facts


def _weights_facts(facts: ModelFacts, folder: Path) -> None:
    """The parameter count and file size from the weight files' headers (once per version of
    the files); the dtype holding most parameters when config.json names none."""
    try:
        signature = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in weight_files(folder))
        summary = _summary(str(folder), signature)
    except (OSError, WeightsError):
        return
    facts.parameters, facts.file_bytes = summary.parameters, summary.file_bytes
    if not facts.quantization_level and summary.dtype in PLAIN_DTYPES:
        facts.quantization_level, facts.bytes_per_parameter = summary.dtype, PLAIN_DTYPES[summary.dtype]


@functools.lru_cache(maxsize=64)
def _summary(path: str, _signature: tuple) -> WeightsSummary:
    return summarize_weights(path)


@functools.lru_cache(maxsize=32)
def _gguf_header_facts(path: str, _mtime_ns: int, _size: int) -> ModelFacts:
    facts = ModelFacts(format="gguf")
    try:
        header = read_header(path)
    except (OSError, GGUFError):
        return facts
    meta = header.metadata
    facts.parameters = sum(t.elements for t in header.tensors)
    facts.quantization_level = header.file_type_name()
    arch = meta.get("general.architecture")
    if isinstance(arch, str):
        facts.family = arch[:64]
        length = meta.get(f"{arch}.context_length")
        if isinstance(length, int) and not isinstance(length, bool) and 0 < length < 2**31:
            facts.context_length = length
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        facts.template, facts.has_template = template, True
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if isinstance(tokens, list) and isinstance(types, list):
        special = {t for t, kind in zip(tokens, types) if kind in GGUF_SPECIAL_TYPES and isinstance(t, str)}
        facts.fim = fim.find(special) is not None
    return facts


def capabilities(facts: ModelFacts) -> list[str]:
    """What a model does, in Ollama's words (its /api/show; the /v1/models cards too):
    `embedding` alone for an embedding model; else `completion`, `tools` with a chat
    template (one that takes `tools` renders them, another gets them in words from the
    worker, and required calls are constrained decoding either way), `insert` when the
    tokenizer has fill-in-the-middle tokens, `vision` when it reads images (docs/vision.md)."""
    if facts.embedding is not None:
        return ["embedding"]
    caps = ["completion"]
    if facts.has_template:
        caps.append("tools")
    if facts.fim:
        caps.append("insert")
    if facts.vision:
        caps.append("vision")
    return caps


PLAIN_DTYPES = {"F16": 2.0, "BF16": 2.0, "F32": 4.0}
_TORCH_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def _dtype_facts(facts: ModelFacts, config: dict[str, Any]) -> None:
    """config.json's quantization (mlx-lm writes `quantization`: bits, group size, mode), else
    its torch_dtype. MLX's affine 4-bit is not a GGUF type, so it is named by its bits ("Q4"),
    not as the llama.cpp type it resembles."""
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 16:
        mode = quant.get("mode") if isinstance(quant, dict) else None
        name = f"Q{bits}" if mode in (None, "affine") or not isinstance(mode, str) else mode.upper()[:16]
        facts.quantization_level, facts.bytes_per_parameter = name, bits / 8
        return
    dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(dtype, str) and dtype in _TORCH_DTYPES:
        facts.quantization_level = _TORCH_DTYPES[dtype]
        facts.bytes_per_parameter = PLAIN_DTYPES[facts.quantization_level]


def _has_fim(folder: Path, tok: dict[str, Any]) -> bool:
    """Fill-in-the-middle tokens among the tokenizer's added or special tokens: those of
    tokenizer_config.json, else tokenizer.json's (where a GGUF import and older saves keep
    them); the worker decides from the same added tokens (worker/prompts.encode_fim)."""
    texts: set[str] = set()
    added = tok.get("added_tokens_decoder")
    if isinstance(added, dict):
        texts |= {t["content"] for t in added.values() if isinstance(t, dict) and isinstance(t.get("content"), str)}
    extra = tok.get("additional_special_tokens")
    if isinstance(extra, list):
        texts |= {t for t in extra if isinstance(t, str)}
    if not isinstance(added, dict):
        texts |= _tokenizer_json_added(folder / "tokenizer.json")
    return fim.find(texts) is not None


class _Added(msgspec.Struct):
    content: str


class _TokenizerJson(msgspec.Struct):
    added_tokens: list[_Added] = []


def _tokenizer_json_added(path: Path) -> frozenset[str]:
    try:
        info = os.stat(path)
    except OSError:
        return frozenset()
    return _added_in(str(path), info.st_mtime_ns, info.st_size)


@functools.lru_cache(maxsize=32)
def _added_in(path: str, _mtime_ns: int, _size: int) -> frozenset[str]:
    """tokenizer.json's added tokens, read once per version of the file (msgspec skips the
    vocabulary and merges without building them)."""
    try:
        parsed = msgspec.json.decode(read_small(path, TOKENIZER_MAX_BYTES), type=_TokenizerJson)
    except (OSError, msgspec.DecodeError):
        return frozenset()
    return frozenset(t.content for t in parsed.added_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_small(path, CONFIG_MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> str | None:
    try:
        return read_small(path, CONFIG_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return None


def parameter_size(estimated_bytes: int, facts: ModelFacts) -> str:
    """Ollama's parameter size ("135M", "134.52M", "1.7B", "8B"), as its HumanNumber writes it:
    from the count in the weights' headers, else estimated from their bytes and dtype ("" when
    neither is known)."""
    count = facts.parameters
    if not count and estimated_bytes and facts.bytes_per_parameter:
        count = int(estimated_bytes / facts.bytes_per_parameter)
    return human_number(count) if count else ""


def human_number(count: int) -> str:
    """1.7B, 8B, 134.52M, 135M, 12K, 999: a whole number of billions or millions without decimals."""
    if count >= 1_000_000_000:
        value = count / 1e9
        return f"{value:.0f}B" if value.is_integer() else f"{value:.1f}B"
    if count >= 1_000_000:
        value = count / 1e6
        return f"{value:.0f}M" if value.is_integer() else f"{value:.2f}M"
    if count >= 1000:
        return f"{count / 1000:.0f}K"
    return str(count)


async def facts_of(paths: list[str]) -> dict[str, ModelFacts]:
    """Each path's facts, read off the loop (empty facts when the read takes too long)."""
    def read() -> dict[str, ModelFacts]:
        return {path: read_facts(path) for path in paths}

    try:
        return await off_loop(read, MODEL_FILES_TIMEOUT, "reading model cards")
    except (OffLoopTimeout, OSError):
        return {path: ModelFacts() for path in paths}


async def require_fim(model_id: str, path: str, param: str = "suffix") -> None:
    """A `suffix` (fill in the middle; `param` names the field that carried it) is refused
    before any load when the model's tokenizer has no FIM tokens, as its card says (no
    `insert` capability)."""
    if not (await facts_of([path]))[path].fim:
        raise BodyError(f"{param}: model {model_id!r} cannot fill in the middle: its tokenizer has no "
                        "fill-in-the-middle tokens (such as <fim_prefix>/<fim_suffix>/<fim_middle> or "
                        "<|fim_prefix|>...); send a plain completion instead", param=param)
