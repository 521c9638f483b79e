"""A prompt-cache entry as one safetensors file, written against a deadline.

Why our own writer and not `mx.save_safetensors`: the disk tier writes while
the guard waits for the worker to exit (H5 as proposed), so a write must stop
at its deadline, not at the end of a file. `mx.save_safetensors` is one call
that holds the interpreter for the whole file; here each tensor leaves in
chunks through plain `write`s (which release the GIL), the deadline checked
before each one, and an entry that misses it leaves no file behind. It is also
zero-copy: a cached KV buffer is usually longer than its tokens (mlx-lm grows
it in steps of 256), and numpy's strided view of the MLX buffer lets each
head's rows go out as they lie, with no contiguous copy of the whole layer
made while the machine may be short of memory.

The file is plain safetensors (8-byte header length, JSON header with
`__metadata__`, the data, 8-byte aligned), so `mx.load` reads it back and any
safetensors tool can inspect it. Reading the index needs only the header.

What comes back is input (SPEC H5.3): files are created 0600 without following
links (shared/private_files.py), a header is parsed with every array's type,
shape and offsets checked before any data is read, and the data carries a
checksum that a read compares before the entry is used.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import mlx.core as mx
import numpy as np
import xxhash

from shared import private_files
from shared.modelinfo import FileRefused

CHUNK_BYTES = 1 << 20   # a deadline is checked at least this often (1 MiB: a few ms on any disk)
MAX_HEADER_BYTES = 16 * 1024 * 1024   # an entry's header holds its tokens: ~8 bytes each
TMP_MARK = private_files.TMP_MARK   # NAME.tmp-PID: a write under way (or abandoned by a process that died)
SAVE_DELAY_ENV = "MEMVISOR_TEST_SAVE_DELAY"   # tests only: seconds each chunk takes (a slow disk)
# The data's checksum, in the metadata (H5.3). xxh3-128 and not sha256: it guards against
# corruption (zeroed or flipped bytes), not against a forger (one who can write the file is kept
# out by its owner and mode, and could rewrite any checksum), and it runs inside a stop's write
# deadline and before every read: ~11 GB/s here against sha256's ~1 GB/s.
CHECKSUM = "checksum"
CHECKSUM_ALGO = "xxh3_128"
_PLACEHOLDER = f"{CHECKSUM_ALGO}:{'0' * 32}"  # in the header as written, replaced once the data is out

_CODES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}
_WIDTHS = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


def dtype_code(dtype: mx.Dtype) -> str:
    """The safetensors code of a KV dtype ("" for one an entry never holds)."""
    return _CODES.get(dtype, "")


class EntryFileError(ValueError):
    """A file that is not a usable entry; the message says why."""


def _test_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(SAVE_DELAY_ENV, "0")))
    except ValueError:
        return 0.0


def host_view(array: mx.array) -> np.ndarray:
    """numpy's view of an evaluated MLX array's own buffer (strides kept, nothing copied)."""
    if array.dtype == mx.bfloat16:  # numpy has no bfloat16: the same bits as uint16
        array = array.view(mx.uint16)
    mx.eval(array)
    return np.asarray(array)


def _pieces(view: np.ndarray) -> Iterator[memoryview]:
    """The array's bytes in C order, as contiguous pieces of at most CHUNK_BYTES."""
    blocks = [view] if view.flags.c_contiguous or view.ndim < 3 else [view[i] for i in np.ndindex(view.shape[:-2])]
    for block in blocks:
        if not block.flags.c_contiguous:
            block = np.ascontiguousarray(block)  # one (tokens x head dim) block, never a whole layer
        raw = block.data.cast("B")
        for start in range(0, len(raw), CHUNK_BYTES):
            yield raw[start:start + CHUNK_BYTES]


def header_bytes(arrays: dict[str, mx.array], metadata: dict[str, str]) -> bytes:
    """The safetensors header for `arrays` in their order, padded so the data starts 8-aligned."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, array in arrays.items():
        code = _CODES.get(array.dtype)
        if code is None:
            raise EntryFileError(f"cannot store {name} of type {array.dtype}")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def entry_size(arrays: dict[str, mx.array], metadata: dict[str, str]) -> int:
    """The bytes `write_entry` will write for these arrays and metadata (its checksum included)."""
    return len(header_bytes(arrays, {**metadata, CHECKSUM: _PLACEHOLDER})) + sum(a.nbytes for a in arrays.values())


def write_entry(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str], *, deadline: float,
                clock: Callable[[], float] = time.monotonic) -> int | None:
    """Write `path` whole, or nothing: its bytes, or None when `deadline` (on `clock`) came first.

    The data goes to `path.tmp-PID`, a file this call creates (0600, O_EXCL,
    never through a link: FileExistsError when anything holds that name), and
    is renamed into place once complete, so a reader never sees half an
    entry; a write that misses its deadline (or raises) removes its temporary
    file. The checksum of the data (`CHECKSUM` in the metadata) is computed
    as the pieces go out and written over its placeholder in the header last.
    """
    assert sys.byteorder == "little", "safetensors data is little-endian"
    delay = _test_delay()
    head = header_bytes(arrays, {**metadata, CHECKSUM: _PLACEHOLDER})
    at = head.index(_PLACEHOLDER.encode())
    tmp = private_files.temporary_name(path)
    if clock() >= deadline:
        return None
    fd = private_files.create_private(tmp)
    done = False
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head)
            digest = xxhash.xxh3_128()
            for array in arrays.values():
                for piece in _pieces(host_view(array)):
                    if delay:
                        time.sleep(delay)
                    if clock() >= deadline:
                        return None
                    digest.update(piece)
                    out.write(piece)
            out.seek(at)
            out.write(f"{CHECKSUM_ALGO}:{digest.hexdigest()}".encode())
        os.replace(tmp, path)
        done = True
        return len(head) + sum(a.nbytes for a in arrays.values())
    finally:
        if not done:
            tmp.unlink(missing_ok=True)  # ours: created above


class Tensor(NamedTuple):
    """One array as a file's header declares it."""

    dtype: str               # the safetensors code: F32, F16, BF16, U32
    shape: tuple[int, ...]
    start: int               # data offsets
    end: int


class Header(NamedTuple):
    """A file's header: its metadata, its arrays in the order of their data, and the data's bytes."""

    metadata: dict[str, str]
    tensors: dict[str, Tensor]
    offset: int    # where the data starts: 8 + the header's length
    data: int


def read_header(handle: BinaryIO, name: str, size: int, *, complete: bool = True) -> Header:
    """The header at `handle`'s start, checked: plausible length, arrays of known types whose
    data lies end to end, and (`complete`) a file exactly as long as it declares. A write
    under way (`complete=False`) has its header whole but not yet its data."""
    length = int.from_bytes(handle.read(8), "little")
    most = min(MAX_HEADER_BYTES, size - 8) if complete else MAX_HEADER_BYTES
    if not 2 <= length <= most:
        raise EntryFileError(f"{name}: implausible header length {length} (file of {size} bytes)")
    raw = handle.read(length)
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__")
        tensors = {key: _tensor(value) for key, value in header.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise EntryFileError(f"{name}: unreadable header ({exc!r})") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise EntryFileError(f"{name}: metadata is not a map of strings")
    ordered = dict(sorted(tensors.items(), key=lambda item: item[1].start))
    data = 0
    for key, tensor in ordered.items():
        if tensor.start != data or tensor.end - tensor.start != math.prod(tensor.shape) * _WIDTHS[tensor.dtype]:
            raise EntryFileError(f"{name}: {key}'s data offsets do not follow its shape or the array before it")
        data = tensor.end
    if complete and 8 + length + data != size:
        raise EntryFileError(f"{name}: {size} bytes, the header declares {8 + length + data}")
    return Header(metadata, ordered, 8 + length, data)


def _tensor(value: dict) -> Tensor:
    dtype, shape, (start, end) = value["dtype"], value["shape"], value["data_offsets"]
    numbers = [*shape, start, end]
    if dtype not in _WIDTHS or not all(type(n) is int and n >= 0 for n in numbers):
        raise ValueError(f"an array of type {dtype!r}, shape {shape!r}, offsets {[start, end]!r}")
    return Tensor(dtype, tuple(shape), start, end)


def read_metadata(path: Path) -> tuple[dict[str, str], int]:
    """A file's metadata and the bytes of data it declares, from its header alone (a regular file
    of ours, never through a link)."""
    try:
        handle = private_files.open_private(path, sys.maxsize)  # the header is capped, not the data
    except FileRefused as exc:
        raise EntryFileError(str(exc)) from None
    with handle:
        header = read_header(handle, path.name, os.fstat(handle.fileno()).st_size)
    return header.metadata, header.data


def checksum_problem(header: Header, arrays: dict[str, mx.array]) -> str | None:
    """Why `arrays` (loaded from the file of `header`) are not the bytes that were written:
    no checksum, or another one. None when they are."""
    written = header.metadata.get(CHECKSUM, "")
    if not written.startswith(CHECKSUM_ALGO + ":"):
        return f"no {CHECKSUM_ALGO} checksum in its metadata"
    digest = xxhash.xxh3_128()
    for key in header.tensors:
        for piece in _pieces(host_view(arrays[key])):
            digest.update(piece)
    if f"{CHECKSUM_ALGO}:{digest.hexdigest()}" != written:
        return "its data does not match its checksum"
    return None
