"""A GGUF file's header read in pure Python: metadata, tensor types and shapes.

Why: SPEC A2 sizes a model before it is loaded, in the supervisor, which never
imports MLX. A GGUF header states every tensor's ggml type and shape, so what
the imported MLX folder will hold is known from one read of the header (the
tensor data is never touched). The importer (`modelfiles.gguf_import`) reads the
same header to say which tensors stay quantized and which are dequantized.

Also here: the importer's progress lines (msgspec Structs, one JSON object a
line on its stdout), so the supervisor's runner and the importer share one
definition of what crosses that pipe.
"""

from __future__ import annotations

import math
import os
import struct
import sys
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING_BYTES = 64 * 1024 * 1024  # a longer key or value is a corrupt file, not a model
# Bounds on what a header may claim (a file is input: a 4 KB sparse file claiming
# billions of empty keys kept the supervisor parsing for 15.6 s). Real models
# have tens of keys, thousands of tensors, vocabularies of a few 100k tokens
# and tokenizer metadata of tens of MB.
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 17
MAX_COUNT = 1 << 22  # items in one metadata array
GGUF_HEADER_MAX_BYTES = 512 * 1024 * 1024  # metadata and tensor table together

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
}

# llama.cpp's `general.file_type` (enum llama_ftype) -> the name its tools and Ollama show.
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0",
}

# What stays quantized once imported (MLX affine, group 32): bits per weight it stores.
MLX_QUANTIZED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
MLX_GROUP_SIZE = 32
# Stored as they are (BF16 widened to float32); other types are dequantized to float16.
MLX_PLAIN_WIDTH = {"F32": 4, "F16": 2, "BF16": 4}
DEQUANTIZED_WIDTH = 2
# `--requantize BITS`: every other matrix is quantized by MLX (affine, this group, float16 scales).
REQUANTIZE_BITS = (4, 8)
REQUANTIZE_GROUP = 64

# metadata value type id -> struct format (fixed-size types)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not a GGUF we can read; the message names the field or tensor."""


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    type_name: str
    offset: int = 0  # of its data, from the file's start

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def file_bytes(self) -> int:
        _name, block, width = _type_by_name(self.type_name)
        return self.elements // block * width

    @property
    def mlx_bytes(self) -> int:
        """Bytes this tensor takes once imported (see MLX_QUANTIZED_BITS)."""
        return self.imported_bytes(0)

    def requantized(self, bits: int) -> bool:
        """Whether `--requantize bits` quantizes this tensor (a matrix not kept quantized)."""
        return (bits > 0 and not self.stays_quantized and len(self.shape) == 2
                and self.shape[0] % REQUANTIZE_GROUP == 0 and self.name.endswith(".weight"))

    def imported_bytes(self, requantize: int = 0) -> int:
        n = self.elements
        bits = MLX_QUANTIZED_BITS.get(self.type_name)
        if bits is not None:  # packed weights + float16 scales and biases per group
            return n * bits // 8 + (n // MLX_GROUP_SIZE) * 2 * 2
        if self.requantized(requantize):
            return n * requantize // 8 + (n // REQUANTIZE_GROUP) * 2 * 2
        return n * MLX_PLAIN_WIDTH.get(self.type_name, DEQUANTIZED_WIDTH)

    @property
    def stays_quantized(self) -> bool:
        return self.type_name in MLX_QUANTIZED_BITS

    @property
    def dequantized(self) -> bool:
        return not self.stays_quantized and self.type_name not in MLX_PLAIN_WIDTH


class GGUFHeader(msgspec.Struct, frozen=True):
    version: int
    metadata: dict[str, object]
    tensors: tuple[TensorInfo, ...]

    def field(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        """A metadata value that must exist; a missing or mistyped one names its key."""
        if key not in self.metadata:
            raise GGUFError(f"GGUF metadata has no {key!r}")
        value = self.metadata[key]
        if not isinstance(value, kind):
            raise GGUFError(f"GGUF metadata {key!r} has an unexpected type ({type(value).__name__})")
        return value

    @property
    def mlx_bytes(self) -> int:
        """What the imported folder holds (SPEC A2's estimate for a `.gguf` model path)."""
        return self.imported_bytes(0)

    def imported_bytes(self, requantize: int = 0) -> int:
        # rope_freqs (Llama 3.1+) becomes config.json's rope_scaling, not a weight
        return sum(t.imported_bytes(requantize) for t in self.tensors if t.name != "rope_freqs.weight")

    @property
    def file_tensor_bytes(self) -> int:
        return sum(t.file_bytes for t in self.tensors)

    def file_type_name(self) -> str:
        """How llama.cpp names the file's quantization (`Q4_K_M`, `Q8_0`, `F16`): its
        `general.file_type`, else the ggml type holding most of the weights ("" for none)."""
        kind = self.metadata.get("general.file_type")
        if isinstance(kind, int) and not isinstance(kind, bool) and kind in FILE_TYPES:
            return FILE_TYPES[kind]
        by_type: dict[str, int] = {}
        for t in self.tensors:
            by_type[t.type_name] = by_type.get(t.type_name, 0) + t.elements
        return max(by_type, key=by_type.__getitem__, default="")


def _type_by_name(name: str) -> tuple[str, int, int]:
    for entry in GGML_TYPES.values():
        if entry[0] == name:
            return entry
    raise GGUFError(f"unknown ggml type {name!r}")


class Readable(Protocol):
    """What the header parser needs of a file: a local one, or a remote one read by ranges."""

    def read(self, n: int, /) -> bytes: ...

    def tell(self) -> int: ...


class _Reader:
    def __init__(self, handle: Readable, path: Path):
        self.handle = handle
        self.path = path
        self.consumed = 0

    def take(self, n: int) -> bytes:
        self.consumed += n
        if self.consumed > GGUF_HEADER_MAX_BYTES:
            raise GGUFError(f"{self.path}: GGUF header larger than {GGUF_HEADER_MAX_BYTES} bytes; refused")
        data = self.handle.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.path}: truncated GGUF header")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        if length > MAX_STRING_BYTES:
            raise GGUFError(f"{self.path}: implausible string length {length} in the GGUF header")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if count > MAX_COUNT:
                raise GGUFError(f"{self.path}: metadata {key!r} claims {count} items")
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind]
                raw = self.take(struct.calcsize(fmt) * count)
                return list(struct.unpack(f"<{count}{fmt[1]}", raw))
            return [self.value(item_kind, key) for _ in range(count)]
        raise GGUFError(f"{self.path}: metadata {key!r} has unknown value type {kind}")


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (versions 2 and 3); `~` is expanded."""
    from shared.modelinfo import FileRefused, open_regular

    path = Path(path).expanduser()
    try:
        with open_regular(path, sys.maxsize) as handle:  # a FIFO or a device is refused, never waited on
            return _parse(_Reader(handle, path))
    except FileNotFoundError:
        raise GGUFError(f"GGUF file not found: {path}") from None
    except IsADirectoryError:
        raise GGUFError(f"{path} is a directory, not a GGUF file") from None
    except FileRefused as exc:
        raise GGUFError(str(exc)) from None
    except (struct.error, UnicodeDecodeError, MemoryError) as exc:
        raise GGUFError(f"{path}: unreadable GGUF header ({exc})") from None


def read_header_from(handle: Readable, label: str) -> GGUFHeader:
    """The header from an open file-like object (`read`, `tell`): a remote file read by
    Range requests (`pull` sizes a GGUF before fetching it). `label` names it in errors."""
    try:
        return _parse(_Reader(handle, Path(label)))
    except (struct.error, UnicodeDecodeError, MemoryError) as exc:
        raise GGUFError(f"{label}: unreadable GGUF header ({exc})") from None


def _parse(reader: _Reader) -> GGUFHeader:
    if reader.take(4) != GGUF_MAGIC:
        raise GGUFError(f"{reader.path} is not a GGUF file (no GGUF magic at its start)")
    version = reader.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"{reader.path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = reader.scalar("<Q"), reader.scalar("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KEYS:
        raise GGUFError(f"{reader.path}: implausible GGUF counts ({n_tensors} tensors, {n_kv} keys)")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"), key)
    tensors = []
    for _ in range(n_tensors):
        name = reader.string()
        n_dims = reader.scalar("<I")
        if n_dims > 8:
            raise GGUFError(f"{reader.path}: tensor {name!r} claims {n_dims} dimensions")
        shape = tuple(reader.scalar("<Q") for _ in range(n_dims))
        type_id = reader.scalar("<I")
        offset = reader.scalar("<Q")  # within the data section
        if type_id not in GGML_TYPES:
            raise GGUFError(f"{reader.path}: tensor {name!r} has unknown ggml type {type_id}")
        tensors.append(TensorInfo(name, shape, GGML_TYPES[type_id][0], offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GGUFError(f"{reader.path}: general.alignment {alignment!r} is not a positive integer")
    start = reader.handle.tell()
    start += -start % alignment
    tensors = [msgspec.structs.replace(t, offset=start + t.offset) for t in tensors]
    return GGUFHeader(version=version, metadata=metadata, tensors=tuple(tensors))


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    return str(path).lower().endswith(".gguf")


# --------------------------------------------------------------------------- importer progress


class ImportProgress(msgspec.Struct, tag="progress", frozen=True):
    """One step of an import: `done` of `total` bytes through `phase`."""

    phase: Literal["convert", "write"]
    done: int
    total: int


class ImportNote(msgspec.Struct, tag="note", frozen=True):
    """Something the user should know (a dequantized tensor group, its size)."""

    text: str


class ImportDone(msgspec.Struct, tag="done", frozen=True):
    out_dir: str
    bytes_written: int
    quantized_tensors: int
    dequantized_tensors: int
    requantized_tensors: int
    seconds: float


class ImportFailed(msgspec.Struct, tag="failed", frozen=True):
    error: str


ImportLine = ImportProgress | ImportNote | ImportDone | ImportFailed
_line_decoder = msgspec.json.Decoder(ImportLine)


def decode_import_line(raw: bytes | str) -> ImportLine | None:
    """One line from the importer; None for anything that is not one of ours (never raises)."""
    try:
        return _line_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
