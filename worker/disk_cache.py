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

With API keys, each entry is one key's (SPEC H7 as proposed): its partition is
in its metadata and its name (worker/kv_folder.py), a request is offered only
its own partition's files, and a file never replaces or shadows another
partition's (the budget stays one for all).

Cheap at start: the index reads each file's header (its tokens), never its
data. A request reads one file, in the worker, when its prompt shares a longer
prefix with a disk entry than with anything in memory.

Trusted only as far as proven (SPEC H5.3): the folders from `$MEMVISOR_CACHE`
down are ours and 0700 or the tier is off (shared/private_files.py); files are
0600, created without following links; only files proven ours (worker/kv_folder.py)
are read or removed; an entry is checked against the model's KV layout, its
checksum and for non-finite values before it enters the memory cache
(worker/kv_layout.py), and a bad one is a miss and is removed, so it can never
be written back; and the folder has one budget at a time (kv_folder.share_budget).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, cast

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from shared import private_files
from shared.modelinfo import read_small
from shared.protocol import DISK_CACHE_AUTO, SHARED_PARTITION, DiskCacheStats
from shared.sizes import GiB, format_size
from worker import kv_files, kv_folder
from worker import prompt_cache as pc
from worker.kv_folder import FORMAT, SUFFIX, NotOurs, Proven, entry_name, folder_name
from worker.kv_layout import KVLayout, finite_problem, layout_problem

__all__ = ["FORMAT", "SUFFIX", "DiskEntry", "DiskTier", "KVLayout", "entry_name", "folder_name", "kv_root",
           "model_identity"]

log = logging.getLogger("memvisor.worker.disk_cache")

MIN_TOKENS = 128           # shorter prefixes re-prefill in about the time a file takes to open
AUTO_SHARE = 4             # "auto": a quarter of (free + held)
FREE_FLOOR = GiB           # never leave less free than this ...
FREE_FLOOR_SHARE = 0.05    # ... or this share of the filesystem

DiskUsage = Callable[[Path], tuple[int, int, int]]  # shutil.disk_usage's (total, used, free)
Layout = KVLayout | Callable[[], KVLayout]          # the model's KV layout, or how to learn it (kv_layout.probe)


def kv_root() -> Path:
    """`$MEMVISOR_CACHE/kv`, beside the BLAS copy (default `~/.cache/memvisor/kv`), made and
    checked private from the caches folder down (NotPrivate when it is not)."""
    return private_files.private_path(private_files.cache_root(), "kv")


def model_identity(model_path: Path) -> str:
    """What makes a model's KV the same KV: config.json and every file's name, size and mtime."""
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(read_small(model_path / "config.json"))
    for file in sorted(model_path.iterdir()):
        if file.is_file():
            info = file.stat()
            digest.update(f"\0{file.name}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()[:20]


class DiskEntry(NamedTuple):
    """One file of this model's folder, as the index knows it."""

    name: str
    tokens: tuple[int, ...]
    nbytes: int      # the file's size
    used: float      # its mtime: when it was written or last read (LRU)
    ino: int = 0     # its inode when proven ours: what may be removed is that file, not what took its name
    partition: str = SHARED_PARTITION  # whose requests it may serve (H7 as proposed)


class SaveResult(NamedTuple):
    written: int
    written_bytes: int
    dropped: int          # not written: the deadline came first
    dropped_bytes: int
    seconds: float


class BadEntry(Exception):
    """An entry of ours whose contents may not be used (cut short, no or another checksum,
    another shape, NaN): a miss, and the file goes."""

    def __init__(self, why: str, ino: int) -> None:
        super().__init__(why)
        self.ino = ino


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

    def __init__(self, root: Path, model_id: str, identity: str, max_bytes: int, *, layout: Layout,
                 disk_usage: DiskUsage = shutil.disk_usage, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.model_id = model_id
        self.identity = identity
        self.folder = root / folder_name(model_id, identity)
        self.setting = max_bytes
        self._layout: Layout | None = layout
        self._disk_usage = disk_usage
        self._clock = clock
        self.scan = kv_folder.FolderScan(root)
        self.entries: dict[str, DiskEntry] = {}
        self.all_bytes = 0
        self.budget = 0
        self.stats = DiskCacheStats(folder=str(self.folder))

    @classmethod
    def open(cls, model_id: str, model_path: Path, max_bytes: int, root: Path | None = None, *,
             layout: Layout, **kw) -> "DiskTier | None":
        """The tier indexed (headers only), or None when it is off, its folders are not ours
        alone, or another supervisor holds the folder with another budget (one log line)."""
        if max_bytes == 0:
            return None
        try:
            if root is None:
                root = kv_root()
            else:
                private_files.private_folder(root)
            tier = cls(root, model_id, model_identity(model_path), max_bytes, layout=layout, **kw)
            tier._start()
        except (OSError, kv_folder.BudgetConflict) as exc:  # NotPrivate says which folder, why, what to do
            log.warning("prompt cache disk tier off: %s", exc)
            return None
        return tier

    def _start(self) -> None:
        private_files.private_folder(self.folder)
        lock = kv_folder.share_budget(self.root, self.setting)
        weakref.finalize(self, os.close, lock)  # held while the tier is: the worker's life
        self.index()

    # -- the index -----------------------------------------------------------------------

    def index(self) -> None:
        """Read every entry's header in this model's folder. A file that is not provably an entry
        of this folder is left alone; one of ours that can never be used is removed."""
        self.entries.clear()
        for name in kv_folder.names(self.folder):
            path = self.folder / name
            if kv_files.TMP_MARK in name:
                self._abandoned(path)
            elif name.endswith(SUFFIX):
                entry = self._indexed(path)
                if entry is not None:
                    self.entries[name] = entry
        self._refresh()
        log.info("prompt cache disk tier: %d entries (%s) in %s; all models %s of %s", len(self.entries),
                 format_size(sum(e.nbytes for e in self.entries.values())), self.folder,
                 format_size(self.all_bytes), format_size(self.budget))

    def _abandoned(self, tmp: Path) -> None:
        """A write whose process died: removed when its header proves it ours."""
        if not _writer_gone(tmp):
            return
        try:
            ours = kv_folder.prove(tmp, written=False)
        except NotOurs as exc:
            self.scan.note(tmp, str(exc))
            return
        kv_folder.remove(tmp, ours.info.st_ino)

    def _indexed(self, path: Path) -> DiskEntry | None:
        try:
            ours = kv_folder.prove(path)
        except NotOurs as exc:
            self.scan.note(path, str(exc))
            return None
        if ours.header.metadata.get("identity") != self.identity:
            self.scan.note(path, "labelled with another identity")
            return None
        problem = _written_problem(ours.header, ours.info)
        if problem is not None:
            self._reject(path, ours.info.st_ino, problem)
            return None
        self.scan.remember(ours)
        return DiskEntry(path.name, ours.tokens, ours.info.st_size, ours.info.st_mtime, ours.info.st_ino,
                         ours.partition)

    def _reject(self, path: Path, ino: int, why: str) -> None:
        """An entry of ours that can never be used: out of the index, removed, counted."""
        log.warning("prompt cache disk tier: %s is a bad entry (%s); removed", path.name, why)
        kv_folder.remove(path, ino)
        self.entries.pop(path.name, None)
        self._restat(rejected_entries=self.stats.rejected_entries + 1)

    def _refresh(self, files: list[Proven] | None = None) -> list[Proven]:
        files = self.scan.files() if files is None else files
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
            all_bytes=self.all_bytes, budget=self.budget, foreign_files=len(self.scan.foreign), **counts)

    # -- reading ---------------------------------------------------------------------------

    def best(self, prompt: Sequence[int], limit: int, longer_than: int,
             partition: str = SHARED_PARTITION) -> DiskEntry | None:
        """`partition`'s entry sharing the longest prefix with `prompt` (at most `limit` tokens),
        when that is more than `longer_than` tokens (what memory already gives). Another
        partition's files are never candidates (H7 as proposed)."""
        best, best_n = None, longer_than
        key = tuple(prompt)
        for entry in self.entries.values():
            if entry.partition != partition:
                continue
            n = min(pc.common_prefix(entry.tokens, key), limit)
            if n > best_n:
                best, best_n = entry, n
        return best

    def load(self, entry: DiskEntry) -> list[pc.Layer] | None:
        """One entry's KV read into memory (evaluated and checked), or None: a file gone or no
        longer provably ours leaves the index; a bad entry of ours is removed (`_reject`)."""
        layout = self._layout_now()
        if layout is None:
            return None
        path = self.folder / entry.name
        try:
            layers = self._read(path, entry, layout)
        except BadEntry as bad:
            self._reject(path, bad.ino, str(bad))
            return None
        except (OSError, NotOurs, kv_files.EntryFileError) as exc:
            log.warning("prompt cache disk tier: cannot read %s (%s); dropped from the index", entry.name, exc)
            self.entries.pop(entry.name, None)
            self._restat()
            return None
        s = self.stats
        self._restat(read_entries=s.read_entries + 1, read_bytes=s.read_bytes + entry.nbytes,
                     read_tokens=s.read_tokens + len(entry.tokens))
        return layers

    def _read(self, path: Path, entry: DiskEntry, layout: KVLayout) -> list[pc.Layer]:
        """The file's header proven ours and matched to the model before its data is read; the
        data checked (checksum, finite) before it is used."""
        with private_files.open_private(path, sys.maxsize) as handle:
            info = os.fstat(handle.fileno())
            header = kv_files.read_header(handle, entry.name, info.st_size, complete=False)
            tokens = kv_folder.entry_tokens(path, header)
            if (header.metadata.get("identity") != self.identity or tokens != entry.tokens
                    or kv_folder.entry_partition(path, header) != entry.partition):
                raise NotOurs("its tokens, partition or model identity changed since the index read it")
            problem = _written_problem(header, info) or layout_problem(header, layout, len(tokens))
            if problem is not None:
                raise BadEntry(problem, info.st_ino)
            handle.seek(0)
            source = private_files.descriptor_path(handle.fileno()) or handle  # MLX's own reader is ~2x faster
            try:
                arrays = cast(dict[str, mx.array], mx.load(source, format="safetensors"))
                mx.eval(list(arrays.values()))
            except (RuntimeError, ValueError) as exc:
                raise BadEntry(f"MLX cannot read it: {exc}", info.st_ino) from None
            problem = kv_files.checksum_problem(header, arrays) or finite_problem(arrays)
            if problem is not None:
                raise BadEntry(problem, info.st_ino)
            os.utime(handle.fileno())  # read now: the young end of the LRU
        return _layers(arrays, header.metadata, len(tokens))

    def _layout_now(self) -> KVLayout | None:
        """The model's KV layout, learned the first time an entry is read (None: reads are off)."""
        if self._layout is None or isinstance(self._layout, KVLayout):
            return self._layout
        try:
            self._layout = self._layout()
        except Exception as exc:  # noqa: BLE001 - a model that cannot be probed only loses its disk reads
            log.warning("prompt cache disk tier: this model's KV layout is unknown (%s); no entry is read", exc)
            self._layout = None
        return self._layout

    # -- writing (at a stop) --------------------------------------------------------------

    def save(self, entries: Sequence[pc.Entry], deadline: float, given: float = 0.0) -> SaveResult:
        """Write `entries` (most valuable first) until `deadline`; what is left is dropped and counted."""
        started = self._clock()
        todo = self._worth_writing(entries)
        files = self._refresh()
        written = written_bytes = dropped = dropped_bytes = 0
        for i, entry in enumerate(todo):
            nbytes = self._write(entry, files, deadline)
            if nbytes is None:
                rest = todo[i:]
                dropped, dropped_bytes = len(rest), sum(e.nbytes for e in rest)
                break
            if nbytes:
                written, written_bytes = written + 1, written_bytes + nbytes
        seconds = self._clock() - started
        s = self.stats
        self._restat(written_entries=s.written_entries + written, written_bytes=s.written_bytes + written_bytes,
                     dropped_entries=s.dropped_entries + dropped, dropped_bytes=s.dropped_bytes + dropped_bytes,
                     save_seconds=seconds, save_deadline=given)
        return SaveResult(written, written_bytes, dropped, dropped_bytes, seconds)

    def _write(self, entry: pc.Entry, files: list[Proven], deadline: float) -> int | None:
        """One entry's file: its bytes, 0 when it is not written (no room, or its name is held by
        something not ours), None when the deadline came first."""
        arrays, metadata = self._encoded(entry)
        size = kv_files.entry_size(arrays, metadata)
        if not self._make_room(files, size):
            log.info("prompt cache disk tier: %d-token entry (%s) does not fit the budget %s; not written",
                     len(entry.tokens), format_size(size), format_size(self.budget))
            return 0
        name = entry_name(entry.tokens, entry.partition)
        path = self.folder / name
        try:
            if os.path.lexists(path):
                kv_folder.prove(path)  # only a file of ours is replaced
            nbytes = kv_files.write_entry(path, arrays, metadata, deadline=deadline, clock=self._clock)
        except (NotOurs, FileExistsError, private_files.NotPrivate) as exc:
            self.scan.note(path, f"its name is taken: {exc}")
            self._restat()
            return 0
        if nbytes is None:
            return None
        info = private_files.regular_of_ours(path)
        entry.disk = name
        self._added(DiskEntry(name, entry.tokens, nbytes, time.time(), info.st_ino if info else 0, entry.partition),
                    files)
        return nbytes

    def _worth_writing(self, entries: Sequence[pc.Entry]) -> list[pc.Entry]:
        """Long enough, not on disk already (those are touched instead), not a prefix of another
        of its partition (another's longer entry must not cost it its file: H7 as proposed)."""
        todo = []
        for entry in entries:
            if len(entry.tokens) < MIN_TOKENS:
                continue
            if entry.disk and entry.disk in self.entries:
                try:
                    os.utime(self.folder / entry.disk, follow_symlinks=False)  # used here: keep it young
                    continue
                except OSError:
                    self.entries.pop(entry.disk, None)  # removed by another worker's budget: write it again
            n = len(entry.tokens)
            if any(len(o.tokens) > n and o.partition == entry.partition and o.tokens[:n] == entry.tokens
                   for o in entries):
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
                    "tokens": json.dumps(list(entry.tokens), separators=(",", ":")), "partition": entry.partition,
                    "layers": str(len(entry.layers)), "bits": str(entry.bits), "group_size": str(group)}
        return arrays, metadata

    def _make_room(self, files: list[Proven], size: int) -> bool:
        """Drop least recently used entry files (any model's, every one proven ours) until `size`
        more fits the budget and leaves the free-space floor; False when it cannot (nothing is
        dropped then)."""
        total, _used, free = self._disk_usage(self.root)
        floor = max(FREE_FLOOR, int(total * FREE_FLOOR_SHARE))
        held = sum(f.nbytes for f in files)
        if size > self.budget or size > free + held - floor:
            return False
        while files and (held + size > self.budget or free - size < floor):
            victim = files.pop(0)
            held -= victim.nbytes
            if victim.path.parent == self.folder:
                self.entries.pop(victim.path.name, None)
            if not kv_folder.remove(victim.path, victim.ino):
                continue  # gone meanwhile (another worker's budget), or no longer the file proven ours
            free += victim.nbytes
            s = self.stats
            self._restat(evicted_entries=s.evicted_entries + 1, evicted_bytes=s.evicted_bytes + victim.nbytes)
        self.all_bytes = held
        return held + size <= self.budget and free - size >= floor

    def _added(self, new: DiskEntry, files: list[Proven]) -> None:
        """A new file is in; this model's files of its partition that hold a prefix of it are not
        needed any more (another partition's stay: H7 as proposed)."""
        n = len(new.tokens)
        for old in [e for e in self.entries.values()
                    if len(e.tokens) < n and e.partition == new.partition and new.tokens[:len(e.tokens)] == e.tokens]:
            kv_folder.remove(self.folder / old.name, old.ino)
            del self.entries[old.name]
            files[:] = [f for f in files if f.path.name != old.name]
        self.entries[new.name] = new
        files.append(Proven(self.folder / new.name, new.ino, new.nbytes, new.used))
        self.all_bytes = sum(f.nbytes for f in files)
        self._restat()


def _written_problem(header: kv_files.Header, info: os.stat_result) -> str | None:
    """What a file of ours lacks that every complete write of this version has."""
    if header.offset + header.data != info.st_size:
        return f"{info.st_size} bytes, its header declares {header.offset + header.data}"
    if kv_files.CHECKSUM not in header.metadata:
        return "no checksum: written by an earlier memvisor"
    return None


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
