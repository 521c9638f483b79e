"""The prompt cache's disk tier (H5 as proposed): a conversation's KV outlives its worker.

When the guard stops a worker (pressure, TTL, keep_alive 0, reload, unload)
its prompt cache used to go with the process, and the next request of the
same chat paid its whole prefill again. Here a stopping worker writes the
entries worth keeping to its model's folder before it exits, within the
grace the stop gives it (`Drain.save_seconds`), and the next worker of the
same model reads back only the entry a request needs.

Where: `$MEMVISOR_CACHE/kv/<model id>-<identity>/` (the same root as the
BLAS copy, `~/.cache/memvisor` by default), one safetensors file per entry
(worker/kv_files.py), its metadata holding the token prefix, the model id and
the model's identity. The identity hashes `config.json` and the name, size and
mtime of every file in the model's folder, so a changed model (new weights, a
new tokenizer) gets a new folder and never reads the old KV; the old folder's
files are the first the budget drops.

The budget (`[guard] disk_cache_max`) bounds every model's files together;
least recently used files (by mtime: set when written and again when read)
go first, whatever model they belong to. "auto" is a quarter of what the
cache's filesystem has free plus what the tier already holds, and no write
ever leaves that filesystem with less than max(1 GiB, 5 %) free.

Cheap at start: the index reads each file's header (its tokens), never its
data. A request reads one file, in the worker, when its prompt shares a longer
prefix with a disk entry than with anything in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, cast

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from shared.modelinfo import read_small
from shared.probe import blas as found
from shared.protocol import DISK_CACHE_AUTO, DiskCacheStats
from shared.sizes import GiB, format_size
from worker import kv_files
from worker import prompt_cache as pc

log = logging.getLogger("memvisor.worker.disk_cache")

FORMAT = "memvisor-kv/1"   # what a file's layout means; another value is never read
MIN_TOKENS = 128           # shorter prefixes re-prefill in about the time a file takes to open
AUTO_SHARE = 4             # "auto": a quarter of (free + held)
FREE_FLOOR = GiB           # never leave less free than this ...
FREE_FLOOR_SHARE = 0.05    # ... or this share of the filesystem
SUFFIX = ".safetensors"

DiskUsage = Callable[[Path], tuple[int, int, int]]  # shutil.disk_usage's (total, used, free)


def kv_root() -> Path:
    """`$MEMVISOR_CACHE/kv`, beside the BLAS copy (default `~/.cache/memvisor/kv`)."""
    return found.cache_dir().parent / "kv"


def model_identity(model_path: Path) -> str:
    """What makes a model's KV the same KV: config.json and every file's name, size and mtime."""
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(read_small(model_path / "config.json"))
    for file in sorted(model_path.iterdir()):
        if file.is_file():
            info = file.stat()
            digest.update(f"\0{file.name}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()[:20]


def folder_name(model_id: str, identity: str) -> str:
    """A file-system-safe, readable folder name for a model at one identity."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id.replace("/", "--"))[:80]
    return f"{readable}-{identity[:16]}"


def entry_name(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("q", tokens).tobytes()).hexdigest()[:24] + SUFFIX


class DiskEntry(NamedTuple):
    """One file of this model's folder, as the index knows it."""

    name: str
    tokens: tuple[int, ...]
    nbytes: int      # the file's size
    used: float      # its mtime: when it was written or last read (LRU)


class SaveResult(NamedTuple):
    written: int
    written_bytes: int
    dropped: int          # not written: the deadline came first
    dropped_bytes: int
    seconds: float


class _File(NamedTuple):
    path: Path
    nbytes: int
    used: float


def _writer_gone(tmp: Path) -> bool:
    """A temporary file whose writing process has exited (an abandoned write)."""
    try:
        pid = int(tmp.name.rsplit(kv_files.TMP_MARK, 1)[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return True
    except PermissionError:
        return False
    return False


class DiskTier:
    """One model's folder of entries, its index, and the budget shared with every other model's."""

    def __init__(self, root: Path, model_id: str, identity: str, max_bytes: int, *,
                 disk_usage: DiskUsage = shutil.disk_usage, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.model_id = model_id
        self.identity = identity
        self.folder = root / folder_name(model_id, identity)
        self.setting = max_bytes
        self._disk_usage = disk_usage
        self._clock = clock
        self.entries: dict[str, DiskEntry] = {}
        self.all_bytes = 0
        self.budget = 0
        self.stats = DiskCacheStats(folder=str(self.folder))

    @classmethod
    def open(cls, model_id: str, model_path: Path, max_bytes: int, root: Path | None = None,
             **kw) -> "DiskTier | None":
        """The tier indexed (headers only), or None when it is off or its folder is unusable."""
        if max_bytes == 0:
            return None
        try:
            tier = cls(root or kv_root(), model_id, model_identity(model_path), max_bytes, **kw)
            tier.index()
        except OSError as exc:
            log.warning("prompt cache disk tier off: %s", exc)
            return None
        return tier

    # -- the index -----------------------------------------------------------------------

    def index(self) -> None:
        """Read every file's header in this model's folder; remove what can never be read."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.entries.clear()
        for path in self.folder.iterdir():
            if kv_files.TMP_MARK in path.name:
                if _writer_gone(path):
                    path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            entry = self._indexed(path)
            if entry is None:
                path.unlink(missing_ok=True)
            else:
                self.entries[path.name] = entry
        self._refresh()
        log.info("prompt cache disk tier: %d entries (%s) in %s; all models %s of %s", len(self.entries),
                 format_size(sum(e.nbytes for e in self.entries.values())), self.folder,
                 format_size(self.all_bytes), format_size(self.budget))

    def _indexed(self, path: Path) -> DiskEntry | None:
        try:
            metadata, _data = kv_files.read_metadata(path)
            tokens = tuple(json.loads(metadata["tokens"]))
            ok = (metadata.get("format") == FORMAT and metadata.get("identity") == self.identity
                  and all(type(t) is int for t in tokens) and path.name == entry_name(tokens))
            info = path.stat()
        except (kv_files.EntryFileError, KeyError, ValueError, RecursionError, OSError) as exc:
            log.warning("prompt cache disk tier: %s is no usable entry (%s); removed", path.name, exc)
            return None
        return DiskEntry(path.name, tokens, info.st_size, info.st_mtime) if ok else None

    def _files(self) -> list[_File]:
        """Every model's entry files under the root (stat only), least recently used first."""
        files = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if not folder.is_dir():
                continue
            for path in folder.glob("*" + SUFFIX):
                try:
                    info = path.stat()
                except OSError:
                    continue  # removed meanwhile by another worker's budget
                files.append(_File(path, info.st_size, info.st_mtime))
        return sorted(files, key=lambda f: f.used)

    def _refresh(self, files: list[_File] | None = None) -> list[_File]:
        files = self._files() if files is None else files
        self.all_bytes = sum(f.nbytes for f in files)
        self.budget = self._budget(self.all_bytes)
        self._restat()
        return files

    def _budget(self, held: int) -> int:
        if self.setting != DISK_CACHE_AUTO:
            return self.setting
        _total, _used, free = self._disk_usage(self.root)
        return (free + held) // AUTO_SHARE

    def _restat(self, **counts: int | float) -> None:
        self.stats = msgspec.structs.replace(
            self.stats, entries=len(self.entries), bytes=sum(e.nbytes for e in self.entries.values()),
            all_bytes=self.all_bytes, budget=self.budget, **counts)

    # -- reading ---------------------------------------------------------------------------

    def best(self, prompt: Sequence[int], limit: int, longer_than: int) -> DiskEntry | None:
        """The entry sharing the longest prefix with `prompt` (at most `limit` tokens), when
        that is more than `longer_than` tokens (what memory already gives)."""
        best, best_n = None, longer_than
        key = tuple(prompt)
        for entry in self.entries.values():
            n = min(pc.common_prefix(entry.tokens, key), limit)
            if n > best_n:
                best, best_n = entry, n
        return best

    def load(self, entry: DiskEntry) -> list[pc.Layer] | None:
        """One entry's KV read into memory (evaluated), or None when the file is gone or unusable."""
        path = self.folder / entry.name
        try:
            arrays, metadata = cast(tuple[dict[str, mx.array], dict[str, str]],
                                    mx.load(str(path), return_metadata=True))
            if metadata.get("identity") != self.identity or tuple(json.loads(metadata["tokens"])) != entry.tokens:
                raise ValueError("its tokens or model identity changed since the index read it")
            layers = _layers(arrays, metadata, len(entry.tokens))
            mx.eval([(c.keys, c.values) for c in layers])
            os.utime(path)  # read now: the young end of the LRU
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            log.warning("prompt cache disk tier: cannot read %s (%s); dropped from the index", entry.name, exc)
            self.entries.pop(entry.name, None)
            if not isinstance(exc, FileNotFoundError):
                path.unlink(missing_ok=True)
            self._restat()
            return None
        s = self.stats
        self._restat(read_entries=s.read_entries + 1, read_bytes=s.read_bytes + entry.nbytes,
                     read_tokens=s.read_tokens + len(entry.tokens))
        return layers

    # -- writing (at a stop) --------------------------------------------------------------

    def save(self, entries: Sequence[pc.Entry], deadline: float, given: float = 0.0) -> SaveResult:
        """Write `entries` (most valuable first) until `deadline`; what is left is dropped and counted."""
        started = self._clock()
        todo = self._worth_writing(entries)
        files = self._refresh()
        written = written_bytes = dropped = dropped_bytes = 0
        for i, entry in enumerate(todo):
            arrays, metadata = self._encoded(entry)
            size = len(kv_files.header_bytes(arrays, metadata)) + sum(a.nbytes for a in arrays.values())
            if not self._make_room(files, size):
                log.info("prompt cache disk tier: %d-token entry (%s) does not fit the budget %s; not written",
                         len(entry.tokens), format_size(size), format_size(self.budget))
                continue
            name = entry_name(entry.tokens)
            nbytes = kv_files.write_entry(self.folder / name, arrays, metadata, deadline=deadline, clock=self._clock)
            if nbytes is None:
                rest = todo[i:]
                dropped, dropped_bytes = len(rest), sum(e.nbytes for e in rest)
                break
            entry.disk = name
            self._added(DiskEntry(name, entry.tokens, nbytes, time.time()), files)
            written, written_bytes = written + 1, written_bytes + nbytes
        seconds = self._clock() - started
        s = self.stats
        self._restat(written_entries=s.written_entries + written, written_bytes=s.written_bytes + written_bytes,
                     dropped_entries=s.dropped_entries + dropped, dropped_bytes=s.dropped_bytes + dropped_bytes,
                     save_seconds=seconds, save_deadline=given)
        return SaveResult(written, written_bytes, dropped, dropped_bytes, seconds)

    def _worth_writing(self, entries: Sequence[pc.Entry]) -> list[pc.Entry]:
        """Long enough, not on disk already (those are touched instead), not a prefix of another."""
        todo = []
        for entry in entries:
            if len(entry.tokens) < MIN_TOKENS:
                continue
            if entry.disk and entry.disk in self.entries:
                try:
                    os.utime(self.folder / entry.disk)  # used by this worker: keep it young
                    continue
                except OSError:
                    self.entries.pop(entry.disk, None)  # removed by another worker's budget: write it again
            n = len(entry.tokens)
            if any(len(o.tokens) > n and o.tokens[:n] == entry.tokens for o in entries):
                continue
            todo.append(entry)
        return todo

    def _encoded(self, entry: pc.Entry) -> tuple[dict[str, mx.array], dict[str, str]]:
        n = len(entry.tokens)
        arrays: dict[str, mx.array] = {}
        group = 0
        for i, layer in enumerate(entry.layers):
            assert layer.keys is not None and layer.values is not None  # stored entries are filled
            if isinstance(layer, QuantizedKVCache):
                group = layer.group_size
                for part, k, v in zip(("q", "scales", "biases"), layer.keys, layer.values):
                    arrays[f"{i}.keys.{part}"], arrays[f"{i}.values.{part}"] = k[..., :n, :], v[..., :n, :]
            else:
                arrays[f"{i}.keys"], arrays[f"{i}.values"] = layer.keys[..., :n, :], layer.values[..., :n, :]
        metadata = {"format": FORMAT, "model": self.model_id, "identity": self.identity,
                    "tokens": json.dumps(list(entry.tokens), separators=(",", ":")),
                    "layers": str(len(entry.layers)), "bits": str(entry.bits), "group_size": str(group)}
        return arrays, metadata

    def _make_room(self, files: list[_File], size: int) -> bool:
        """Drop least recently used files (any model's) until `size` more fits the budget and
        leaves the free-space floor; False when it cannot (nothing is dropped then)."""
        total, _used, free = self._disk_usage(self.root)
        floor = max(FREE_FLOOR, int(total * FREE_FLOOR_SHARE))
        held = sum(f.nbytes for f in files)
        if size > self.budget or size > free + held - floor:
            return False
        while files and (held + size > self.budget or free - size < floor):
            victim = files.pop(0)
            try:
                victim.path.unlink()
            except FileNotFoundError:
                pass
            held -= victim.nbytes
            free += victim.nbytes
            if victim.path.parent == self.folder:
                self.entries.pop(victim.path.name, None)
            s = self.stats
            self._restat(evicted_entries=s.evicted_entries + 1, evicted_bytes=s.evicted_bytes + victim.nbytes)
        self.all_bytes = held
        return held + size <= self.budget and free - size >= floor

    def _added(self, new: DiskEntry, files: list[_File]) -> None:
        """A new file is in; this model's files that hold a prefix of it are not needed any more."""
        n = len(new.tokens)
        for old in [e for e in self.entries.values() if len(e.tokens) < n and new.tokens[:len(e.tokens)] == e.tokens]:
            (self.folder / old.name).unlink(missing_ok=True)
            del self.entries[old.name]
            files[:] = [f for f in files if f.path.name != old.name]
        self.entries[new.name] = new
        files.append(_File(self.folder / new.name, new.nbytes, new.used))
        self.all_bytes = sum(f.nbytes for f in files)
        self._restat()


def _layers(arrays: dict[str, mx.array], metadata: dict[str, str], n: int) -> list[pc.Layer]:
    """Per-layer caches from a file's arrays, each exactly `n` tokens long."""
    bits, group = int(metadata["bits"]), int(metadata["group_size"])
    layers: list[pc.Layer] = []
    for i in range(int(metadata["layers"])):
        if bits:
            keys = tuple(arrays[f"{i}.keys.{part}"] for part in ("q", "scales", "biases"))
            values = tuple(arrays[f"{i}.values.{part}"] for part in ("q", "scales", "biases"))
            q = QuantizedKVCache(group_size=group, bits=bits)
            q.state = (keys, values, n, group, bits)
            layer: pc.Layer = q
            length = keys[0].shape[-2]
        else:
            f = KVCache()
            f.keys, f.values = arrays[f"{i}.keys"], arrays[f"{i}.values"]
            layer, length = f, f.keys.shape[-2]
        if length != n:
            raise ValueError(f"layer {i} holds {length} tokens, the entry {n}")
        layer.offset = n
        layers.append(layer)
    return layers
