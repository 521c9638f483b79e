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
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from shared.modelinfo import FileRefused, open_regular

CHUNK_BYTES = 1 << 20   # a deadline is checked at least this often (1 MiB: a few ms on any disk)
MAX_HEADER_BYTES = 16 * 1024 * 1024   # an entry's header holds its tokens: ~8 bytes each
TMP_MARK = ".tmp-"      # NAME.tmp-PID: a write under way (or abandoned by a process that died)
SAVE_DELAY_ENV = "MEMVISOR_TEST_SAVE_DELAY"   # tests only: seconds each chunk takes (a slow disk)

_CODES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


class EntryFileError(ValueError):
    """A file that is not a usable entry; the message says why."""


def _test_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(SAVE_DELAY_ENV, "0")))
    except ValueError:
        return 0.0


def _host_view(array: mx.array) -> np.ndarray:
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


def write_entry(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str], *, deadline: float,
                clock: Callable[[], float] = time.monotonic) -> int | None:
    """Write `path` whole, or nothing: its bytes, or None when `deadline` (on `clock`) came first.

    The data goes to `path.tmp-PID` and is renamed into place once complete,
    so a reader never sees half an entry; a write that misses its deadline
    (or raises) removes its temporary file.
    """
    assert sys.byteorder == "little", "safetensors data is little-endian"
    delay = _test_delay()
    head = header_bytes(arrays, metadata)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    done = False
    try:
        if clock() >= deadline:
            return None
        with open(tmp, "wb") as out:
            out.write(head)
            for array in arrays.values():
                for piece in _pieces(_host_view(array)):
                    if delay:
                        time.sleep(delay)
                    if clock() >= deadline:
                        return None
                    out.write(piece)
        os.replace(tmp, path)
        done = True
        return len(head) + sum(a.nbytes for a in arrays.values())
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def read_metadata(path: Path) -> tuple[dict[str, str], int]:
    """An entry file's metadata and the bytes of data it declares, from its header alone."""
    try:
        handle = open_regular(path, sys.maxsize)  # the header is capped below, not the data
    except FileRefused as exc:
        raise EntryFileError(str(exc)) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        length = int.from_bytes(handle.read(8), "little")
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise EntryFileError(f"{path.name}: implausible header length {length} (file of {size} bytes)")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__")
        data = sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0]) for t in header.values())
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise EntryFileError(f"{path.name}: unreadable header ({exc!r})") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise EntryFileError(f"{path.name}: metadata is not a map of strings")
    if 8 + length + data != size:
        raise EntryFileError(f"{path.name}: {size} bytes, the header declares {8 + length + data}")
    return metadata, data
