"""What a model's small files say about it, for model cards (`/v1/models`, Ollama's
`/api/tags`, `/api/show`), read without MLX (issue 23).

Why a module of its own: the OpenAI card wants the context length, Ollama's
`/api/show` wants the architecture, the chat template, whether tools and
fill-in-the-middle work, and a parameter size; all of it lives in
`config.json` and `tokenizer_config.json` (or `chat_template.jinja`) beside the
weights. Every read goes through `shared.modelinfo.read_small` (regular files
only, size-capped: a models folder is input, issue 21) and callers run
`read_facts` off the loop, so a slow disk never stalls a token stream.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

from shared.embedding import EmbeddingSpec, read_embedding_spec
from shared.modelinfo import CONFIG_MAX_BYTES, context_length, read_config_json, read_small

# Token spellings of fill-in-the-middle prefixes across families (Qwen/StarCoder, CodeLlama,
# DeepSeek, Codestral): a tokenizer that has one can complete code between a prefix and a suffix.
FIM_MARKERS = ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "<｜fim▁begin｜>", "[PREFIX]")


class ModelFacts(msgspec.Struct, kw_only=True):
    """The facts of one model path; every field optional ("" / 0 / None: not known)."""

    format: str = "safetensors"  # "safetensors" | "gguf"
    family: str = ""  # config.json model_type, e.g. "llama"
    context_length: int | None = None
    template: str = ""  # the chat template, as the tokenizer config carries it
    has_template: bool = False
    fim: bool = False
    quantization_level: str = ""  # "Q4", "Q8", "F16", "BF16", "F32"
    bytes_per_parameter: float = 0.0  # from the dtype or quantization bits (0: unknown)
    file_bytes: int = 0  # a .gguf file's own size
    modified: float = 0.0  # mtime of config.json (a .gguf file's own); 0: unknown
    embedding: EmbeddingSpec | None = None  # a sentence-embedding model's facts (None: it generates)


def digest(model_id: str, path: str) -> str:
    """A stable id for a model entry (Ollama shows one per model): the same id and path
    always give the same digest, another path another."""
    return hashlib.sha256(f"{model_id}\0{path}".encode()).hexdigest()


def read_facts(path: str) -> ModelFacts:
    """What `path` (a model folder, or a .gguf file) says; blocking: run it off the loop."""
    folder = Path(path).expanduser()
    if folder.suffix.lower() == ".gguf":
        facts = ModelFacts(format="gguf", quantization_level="")
        try:
            info = folder.stat()
            facts.file_bytes, facts.modified = info.st_size, info.st_mtime
        except OSError:
            pass
        return facts
    facts = ModelFacts(context_length=context_length(folder))
    try:
        facts.modified = (folder / "config.json").stat().st_mtime
    except OSError:
        pass
    config = read_config_json(folder) or {}
    _dtype_facts(facts, config)
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
    facts.fim = _has_fim(tok)
    facts.embedding = read_embedding_spec(folder)
    if facts.embedding is not None:  # the longest input it embeds, not its position table
        facts.context_length = facts.embedding.max_tokens
    return facts


def capabilities(facts: ModelFacts) -> list[str]:
    """What a model does, in Ollama's words (its /api/show; the /v1/models cards too):
    `embedding` alone for an embedding model; else `completion`, `tools` with a chat
    template (one that takes `tools` renders them, another gets them in words from the
    worker, and required calls are constrained decoding either way), `insert` when the
    tokenizer has fill-in-the-middle tokens."""
    if facts.embedding is not None:
        return ["embedding"]
    caps = ["completion"]
    if facts.has_template:
        caps.append("tools")
    if facts.fim:
        caps.append("insert")
    return caps


def _dtype_facts(facts: ModelFacts, config: dict[str, Any]) -> None:
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 16:
        facts.quantization_level, facts.bytes_per_parameter = f"Q{bits}", bits / 8
        return
    dtype = config.get("torch_dtype") or config.get("dtype")
    sizes = {"float16": ("F16", 2.0), "bfloat16": ("BF16", 2.0), "float32": ("F32", 4.0)}
    if isinstance(dtype, str) and dtype in sizes:
        facts.quantization_level, facts.bytes_per_parameter = sizes[dtype]


def _has_fim(tok: dict[str, Any]) -> bool:
    """Fill-in-the-middle tokens among the tokenizer's added or special tokens."""
    texts: list[str] = []
    added = tok.get("added_tokens_decoder")
    if isinstance(added, dict):
        texts += [t.get("content", "") for t in added.values() if isinstance(t, dict)]
    extra = tok.get("additional_special_tokens")
    if isinstance(extra, list):
        texts += [t if isinstance(t, str) else "" for t in extra]
    return any(isinstance(t, str) and t in FIM_MARKERS for t in texts)


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
    """Ollama's "8.0B"-style size, estimated from the weights' bytes and their dtype
    ("" when either is unknown)."""
    if not estimated_bytes or not facts.bytes_per_parameter:
        return ""
    count = estimated_bytes / facts.bytes_per_parameter
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return f"{count:.0f}"
