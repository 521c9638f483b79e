"""Weight size of a model directory, read from safetensors headers without MLX.

Why: SPEC A2 estimates a model's size from its weight files *before* loading
it, and that estimate is made in the supervisor, which never imports MLX. The
safetensors header states every tensor's byte range, so the sum is exact and
costs one small read per file (no tensor data is touched).

Why a cache: the supervisor's loop must never wait on the disk. The
arbiter reads a model's headers on a worker thread, with a time bound, before
anything on the loop asks; `estimate_weight_bytes` then answers from what was
read, as long as the files have not changed since (their sizes and mtimes). A
read still under way answers "still being read" instead of reading again.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from shared.gguf import GGUFError, is_gguf_path, read_header
from shared.modelinfo import FileRefused, attention_shape, dtype_bytes, open_regular, read_config_json

SAFETENSORS_HEADER_MAX_BYTES = 100 * 1024 * 1024  # the safetensors format's own cap


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


def safetensors_header(file: str | os.PathLike[str]) -> dict[str, Any]:
    """One safetensors file's header (tensor name -> dtype, shape, data_offsets), read bounded."""
    try:
        handle = open_regular(file, sys.maxsize)
    except FileRefused as exc:
        raise WeightsError(str(exc)) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) < 8:
            raise WeightsError(f"{file}: too short to be a safetensors file")
        length = int.from_bytes(head, "little")
        if length > SAFETENSORS_HEADER_MAX_BYTES or length > size - 8:
            raise WeightsError(f"{file}: implausible safetensors header length {length} "
                               f"(file of {size} bytes, cap {SAFETENSORS_HEADER_MAX_BYTES})")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise WeightsError(f"{file}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{file}: safetensors header is not an object")
    return header


def tensor_bytes(file: str | os.PathLike[str]) -> int:
    """Bytes of tensor data one safetensors file declares in its header."""
    total = 0
    for name, entry in safetensors_header(file).items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            total += int(end) - int(begin)
        except (TypeError, KeyError, ValueError):
            raise WeightsError(f"{file}: tensor {name!r} has no valid data_offsets") from None
    return total


class WeightsSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a model's weight files say of the model itself (Ollama's model cards: `size`,
    `parameter_size`, `quantization_level`), read from headers only.

    `parameters` counts the model's own parameters: a quantized matrix (MLX packs 32/bits
    values in each uint32) counts its unpacked values, and its scales and biases are not
    parameters. `file_bytes` is the weight files' size on disk (what Ollama calls a model's
    size). `dtype` is the type holding most parameters: safetensors' (`F16`, `BF16`, `F32`) or,
    for a GGUF, its file type as llama.cpp names it (`Q4_K_M`, `Q8_0`, `F16`)."""

    parameters: int = 0
    file_bytes: int = 0
    dtype: str = ""


def summarize_weights(path: str | os.PathLike[str]) -> WeightsSummary:
    """The summary of the model at `path` (a folder, or a .gguf file); WeightsError when its
    headers cannot be read."""
    if is_gguf_path(path):
        return _gguf_summary(Path(path).expanduser())
    config = read_config_json(path) or {}
    quant = config.get("quantization")
    quant = quant if isinstance(quant, dict) else {}
    parameters, by_dtype, file_bytes = 0, Counter[str](), 0
    for file in weight_files(path):
        file_bytes += file.stat().st_size
        header = safetensors_header(file)
        for name, entry in header.items():
            count, dtype = _parameters_of(name, entry, header, quant)
            parameters += count
            by_dtype[dtype] += count
    dtype = by_dtype.most_common(1)[0][0] if by_dtype else ""
    return WeightsSummary(parameters=parameters, file_bytes=file_bytes, dtype=dtype)


def _parameters_of(name: str, entry: object, header: dict[str, Any], quant: dict[str, Any]) -> tuple[int, str]:
    """(parameters, dtype) of one tensor: 0 for metadata and for a quantized matrix's scales and
    biases; a packed uint32 matrix counts 32/bits values a word (the layer's own bits when the
    config gives some, else the model's)."""
    if name == "__metadata__" or not isinstance(entry, dict):
        return 0, ""
    shape, dtype = entry.get("shape"), entry.get("dtype")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return 0, ""
    count = math.prod(shape)
    stem, _, leaf = name.rpartition(".")
    packed = header.get(f"{stem}.weight", {})
    if leaf in ("scales", "biases") and isinstance(packed, dict) and packed.get("dtype") == "U32":
        return 0, ""
    if dtype == "U32" and leaf == "weight" and f"{stem}.scales" in header:
        layer = quant.get(stem)
        bits = (layer if isinstance(layer, dict) else quant).get("bits")
        if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 32:
            return count * 32 // bits, f"Q{bits}"
    return count, str(dtype)


def _gguf_summary(path: Path) -> WeightsSummary:
    try:
        header = read_header(path)
        size = path.stat().st_size
    except (GGUFError, OSError) as exc:
        raise WeightsError(str(exc)) from None
    return WeightsSummary(parameters=sum(t.elements for t in header.tensors), file_bytes=size,
                          dtype=header.file_type_name())


_PENDING = object()
Signature = tuple[tuple[str, int, int, int], ...]
_lock = threading.Lock()
_known: dict[str, tuple[Signature, object]] = {}  # path -> (files' signature, bytes | error words | _PENDING)


def _signature(path: str | os.PathLike[str]) -> Signature:
    """What identifies the weight files as read: names, sizes and mtimes (stat only)."""
    if is_gguf_path(path):
        try:
            info = os.stat(Path(path).expanduser())
        except FileNotFoundError:
            raise WeightsError(f"GGUF file not found: {path}") from None
        return ((str(path), info.st_ino, info.st_size, info.st_mtime_ns),)
    out = []
    for file in weight_files(path):
        info = file.stat()
        out.append((file.name, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(out)


def estimate_weight_bytes(path: str | os.PathLike[str]) -> int:
    """Total tensor bytes of the model at `path` (what loading it will allocate).

    A `.gguf` file is sized as the MLX folder it imports to (its header states
    each tensor's type and shape; see `shared.gguf.TensorInfo.mlx_bytes`).
    Answered from the last read of the same unchanged files when there is one.
    """
    key = str(path)
    signature = _signature(path)
    with _lock:
        known = _known.get(key)
        if known is None or known[0] != signature:
            _known[key] = (signature, _PENDING)
            known = None
    if known is not None:
        value = known[1]
        if value is _PENDING:
            raise WeightsError(f"{path}: its headers are still being read (a slow disk?); try again")
        if isinstance(value, str):
            raise WeightsError(value)
        assert isinstance(value, int)
        return value
    try:
        total = _read_weight_bytes(path)
    except WeightsError as exc:
        _remember(key, signature, str(exc))
        raise
    except BaseException:
        with _lock:
            _known.pop(key, None)  # transient (an OSError): read again next time
        raise
    _remember(key, signature, total)
    return total


def _remember(key: str, signature: Signature, value: object) -> None:
    with _lock:
        if _known.get(key, (None,))[0] == signature:
            _known[key] = (signature, value)


def _read_weight_bytes(path: str | os.PathLike[str]) -> int:
    if is_gguf_path(path):
        try:
            return read_header(path).mlx_bytes
        except GGUFError as exc:
            raise WeightsError(str(exc)) from None
    return sum(tensor_bytes(file) for file in weight_files(path))


def kv_bytes_per_token(path: str | os.PathLike[str]) -> int:
    """KV-cache bytes one token of context costs, from the model's config.json.

    2 (keys and values) x layers x KV heads x head width x the activation
    dtype's bytes: exact for standard attention models, which is what "will
    it fit with N tokens of context?" needs before anything is loaded. A model
    whose config does not say is costed at 0 (weights only) rather than guessed.
    """
    config = read_config_json(path)  # bounded: a regular file of at most a few MB
    if config is None:
        return 0
    return attention_shape(config).kv_bytes_per_token(dtype_bytes(config))
