"""Weight size of a model directory, read from safetensors headers without MLX.

Why: SPEC A2 estimates a model's size from its weight files *before* loading
it, and that estimate is made in the supervisor, which never imports MLX. The
safetensors header states every tensor's byte range, so the sum is exact and
costs one small read per file (no tensor data is touched).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.gguf import GGUFError, is_gguf_path, read_header

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own cap


class WeightsError(ValueError):
    """A model directory whose weights cannot be sized; the message says why."""


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files mlx_lm.load reads weights from (`model*.safetensors`), sorted."""
    directory = Path(path)
    if not directory.is_dir():
        raise WeightsError(f"model directory not found: {directory}")
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise WeightsError(f"no model*.safetensors weight files in {directory}")
    return files


def tensor_bytes(file: str | os.PathLike[str]) -> int:
    """Bytes of tensor data one safetensors file declares in its header."""
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise WeightsError(f"{file}: too short to be a safetensors file")
        length = int.from_bytes(head, "little")
        if length > MAX_HEADER_BYTES:
            raise WeightsError(f"{file}: implausible safetensors header length {length}")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise WeightsError(f"{file}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{file}: safetensors header is not an object")
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            total += int(end) - int(begin)
        except (TypeError, KeyError, ValueError):
            raise WeightsError(f"{file}: tensor {name!r} has no valid data_offsets") from None
    return total


def estimate_weight_bytes(path: str | os.PathLike[str]) -> int:
    """Total tensor bytes of the model at `path` (what loading it will allocate).

    A `.gguf` file is sized as the MLX folder it imports to (its header states
    each tensor's type and shape; see `shared.gguf.TensorInfo.mlx_bytes`).
    """
    if is_gguf_path(path):
        try:
            return read_header(path).mlx_bytes
        except GGUFError as exc:
            raise WeightsError(str(exc)) from None
    return sum(tensor_bytes(file) for file in weight_files(path))


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(path: str | os.PathLike[str]) -> int:
    """KV-cache bytes one token of context costs, from the model's config.json.

    2 (keys and values) x layers x KV heads x head width x the activation
    dtype's bytes: exact for standard attention models, which is what "will
    it fit with N tokens of context?" needs before anything is loaded. A model
    whose config does not say is costed at 0 (weights only) rather than guessed.
    """
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(config, dict):
        return 0
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    layers = _int(config.get("num_hidden_layers"))
    heads = _int(config.get("num_attention_heads"))
    kv_heads = _int(config.get("num_key_value_heads")) or heads
    hidden = _int(config.get("hidden_size"))
    head_dim = _int(config.get("head_dim")) or (hidden // heads if heads else 0)
    width = _DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or ""), 2)
    return 2 * layers * kv_heads * head_dim * width


def _int(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0
