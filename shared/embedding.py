"""What a model folder says about sentence embeddings, read without MLX.

Why in `shared/`: the supervisor must know, before any worker exists, whether a
model embeds or chats (a chat request to an embedder, or the reverse, is a 400
in the API's own shape, not a worker error), how many dimensions its vectors
have (the batch cap and `dimensions`), and how long an input may be; the
worker needs the same facts to pool and normalise as the model was trained.
One reader serves both.

A sentence-transformers folder says it all in small JSON files beside the
weights: `modules.json` lists the pipeline (Transformer, Pooling, Normalize),
the Pooling module's `config.json` says how token vectors become one
(`pooling_mode_mean_tokens`, `_cls_token`, `_max_tokens`,
`_mean_sqrt_len_tokens`), `sentence_bert_config.json` the longest input
(`max_seq_length`). A folder with a Pooling module is an embedding model;
which encoders the worker can run is the worker's business (it refuses the
others by name at load).

Every read goes through `shared.modelinfo.read_small` (regular files only,
size-capped): a models folder is input. Blocking: run it off the
supervisor's loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from shared.modelinfo import CONFIG_MAX_BYTES, read_config_json, read_small
from shared.vocab import FailureCode

Pooling = Literal["mean", "cls", "max", "mean_sqrt_len"]

# OpenAI's own cap on the inputs of one request.
MAX_EMBED_INPUTS = 2048
# The vectors of one reply travel in one frame, which a peer refuses past
# shared.protocol.MAX_FRAME_BYTES (4 MiB); a quarter is left for the rest.
EMBED_REPLY_BYTES = 3 * 1024 * 1024
FLOAT_BYTES = 4  # vectors travel as float32
# The code of a request for the other kind of model (chat to an embedder, embeddings to a chat model).
WRONG_MODEL_KIND: FailureCode = "wrong_model_kind"

_POOLING_KEYS: tuple[tuple[str, Pooling], ...] = (
    ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"), ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"))
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


class EmbeddingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How one model turns text into a vector, from its folder's files."""

    family: str  # config.json model_type ("bert")
    dims: int  # length of a vector
    pooling: Pooling
    normalize: bool  # a Normalize module: vectors have unit length
    max_tokens: int  # the longest input in tokens, special tokens included
    # Matryoshka: the lengths the model was trained to be cut to (config.json or
    # config_sentence_transformers.json `matryoshka_dimensions`); () when it says none
    matryoshka: tuple[int, ...] = ()

    def allows_dimensions(self, dimensions: int) -> bool:
        """Its own length always; a shorter one only where the model was trained for it."""
        return dimensions == self.dims or dimensions in self.matryoshka

    def input_cap(self, dimensions: int | None = None) -> int:
        """The most inputs one request may embed: OpenAI's cap, and what one reply frame holds."""
        width = max(1, dimensions or self.dims) * FLOAT_BYTES
        return max(1, min(MAX_EMBED_INPUTS, EMBED_REPLY_BYTES // width))


def read_embedding_spec(path: str | Path) -> EmbeddingSpec | None:
    """The folder's embedding facts, or None when it is not a sentence-embedding model
    (no modules.json with a Pooling module, or files that cannot be read)."""
    folder = Path(path).expanduser()
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = {m.get("type"): m for m in modules if isinstance(m, dict)}
    pool_module = kinds.get(_ST_POOLING)
    if pool_module is None:
        return None
    config = read_config_json(folder) or {}
    pool = _json(folder / str(pool_module.get("path") or "") / "config.json")
    pool = pool if isinstance(pool, dict) else {}
    hidden = _positive(config.get("hidden_size"))
    dims = _positive(pool.get("word_embedding_dimension")) or hidden
    if not dims:
        return None
    pooling: Pooling = next((name for key, name in _POOLING_KEYS if pool.get(key) is True), "mean")
    return EmbeddingSpec(
        family=str(config.get("model_type") or "")[:64], dims=dims, pooling=pooling,
        normalize=_ST_NORMALIZE in kinds, max_tokens=_max_tokens(folder, config),
        matryoshka=_matryoshka(folder, config, dims))


def _max_tokens(folder: Path, config: dict[str, Any]) -> int:
    """sentence-transformers' max_seq_length (what it truncates to), within the position table."""
    positions = _positive(config.get("max_position_embeddings")) or 512
    st = _json(folder / "sentence_bert_config.json")
    declared = _positive(st.get("max_seq_length")) if isinstance(st, dict) else None
    return min(declared or positions, positions)


def _matryoshka(folder: Path, config: dict[str, Any], dims: int) -> tuple[int, ...]:
    st = _json(folder / "config_sentence_transformers.json")
    for source in (config, st if isinstance(st, dict) else {}):
        raw = source.get("matryoshka_dimensions")
        if isinstance(raw, list):
            return tuple(sorted({d for d in (_positive(x) for x in raw) if d and d <= dims}))
    return ()


def _positive(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
        return value
    return None


def _json(path: Path) -> object:
    try:
        return json.loads(read_small(path, CONFIG_MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
