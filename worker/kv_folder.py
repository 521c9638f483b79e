"""The disk tier's folder, `$MEMVISOR_CACHE/kv/`: what in it is provably ours, the one way a
file there is removed, and the budget every worker of the folder shares (SPEC H5.3, H5.4).

Why: the budget's eviction listed `*.safetensors` in every folder under
`kv/`, followed folder links and deleted the oldest: a user's
`kv/other/my-finetune.safetensors` and `kv/linked -> elsewhere/important.safetensors`
went with the first saves. Now nothing under `kv/` is followed when it is a
symbolic link, and a file is ours only when it is a regular file of this
user that nobody else can write, whose header parses as an entry
(`FORMAT`) labelled for the very folder it lies in (its model and identity
give that folder's name) and whose name is the hash of its partition and
tokens. Anything else is left where it is, said once in the log and counted
(`DiskCacheStats.foreign_files`).

With API keys an entry belongs to one key's partition (SPEC H7 as proposed):
its metadata names it, and its file name hashes it with the tokens, so the same
tokens of two keys are two files and a file relabelled for another key no
longer proves ours. The shared partition (no keys) keeps the names it had.

Two supervisors with different `disk_cache_max` on one folder deleted each
other's entries without a word: each budget was right by itself. The folder
now has one budget at a time (`share_budget`): every worker that uses it holds
a shared lock on `kv/budget.lock`, whose content is the setting they share; a
worker whose setting differs from the one held turns its tier off with one
line naming both. Workers of one supervisor, or of two with the same setting,
share the folder as before.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import sys
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from shared import private_files
from shared.protocol import DISK_CACHE_AUTO, SHARED_PARTITION
from shared.sizes import format_size
from worker import kv_files

log = logging.getLogger("memvisor.worker.disk_cache")

FORMAT = "memvisor-kv/1"   # what a file's layout means; another value is never read, never removed
SUFFIX = ".safetensors"
LOCK_NAME = "budget.lock"
_FOLDER = re.compile(r"[A-Za-z0-9._-]+-[0-9a-f]{16}")   # what folder_name makes
_PARTITION = re.compile(r"([0-9a-f]{32})?")              # shared.protocol.Partition's shape
LOCK_WAIT = 2.0            # seconds to wait for a moment's exclusive hold (a worker writing the setting) to end


def folder_name(model_id: str, identity: str) -> str:
    """A file-system-safe, readable folder name for a model at one identity."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id.replace("/", "--"))[:80]
    return f"{readable}-{identity[:16]}"


def entry_name(tokens: Sequence[int], partition: str = SHARED_PARTITION) -> str:
    """The file name of `partition`'s entry of `tokens` (the shared partition's: of the tokens alone)."""
    salt = partition.encode() + b"\0" if partition else b""
    return hashlib.sha256(salt + array("q", tokens).tobytes()).hexdigest()[:24] + SUFFIX


def entry_partition(path: Path, header: kv_files.Header) -> str:
    """The partition an entry's header names (none: the shared one); NotOurs when it is no partition."""
    partition = header.metadata.get("partition", SHARED_PARTITION)
    if _PARTITION.fullmatch(partition) is None:
        raise NotOurs(f"{path.name} names no partition this server makes")
    return partition


def is_tier_folder(name: str) -> bool:
    """A name `folder_name` could have made (anything else under kv/ is not looked into)."""
    return _FOLDER.fullmatch(name) is not None


class NotOurs(Exception):
    """A file under kv/ that is not provably one of our entries: it is never read nor removed."""


class Ours(NamedTuple):
    """A file proven ours by its header (its data not yet checked)."""

    path: Path
    info: os.stat_result
    header: kv_files.Header
    tokens: tuple[int, ...]

    @property
    def partition(self) -> str:
        """Whose entry it is (SPEC H7 as proposed): checked by `entry_tokens` when it was proven."""
        return self.header.metadata.get("partition", SHARED_PARTITION)

    @property
    def whole(self) -> bool:
        """As long as its header declares (a write renamed into place is)."""
        return self.header.offset + self.header.data == self.info.st_size


def entry_tokens(path: Path, header: kv_files.Header, *, written: bool = True) -> tuple[int, ...]:
    """The tokens of the entry `header` describes, when it proves the file at `path` ours:
    our format, labelled for the folder it lies in, named for its tokens (`written`; a
    temporary file is named for them plus its writer's mark). Raises NotOurs otherwise."""
    metadata = header.metadata
    if metadata.get("format") != FORMAT:
        raise NotOurs(f"{path.name} is no {FORMAT} entry")
    if path.parent.name != folder_name(metadata.get("model", ""), metadata.get("identity", "")):
        raise NotOurs(f"{path.name} is labelled for another model's folder")
    try:
        tokens = tuple(json.loads(metadata["tokens"]))
    except (KeyError, ValueError, RecursionError):
        raise NotOurs(f"{path.name} has no readable tokens") from None
    if not all(type(t) is int for t in tokens):
        raise NotOurs(f"{path.name} has tokens that are not integers")
    name = path.name.split(private_files.TMP_MARK, 1)[0] if not written else path.name
    if name != entry_name(tokens, entry_partition(path, header)):
        raise NotOurs(f"{path.name} is not named for its partition and tokens")
    return tokens


def prove(path: Path, *, written: bool = True) -> Ours:
    """`path` read (its header only, never through a link) and proven ours, or NotOurs saying why."""
    if private_files.regular_of_ours(path) is None:
        raise NotOurs(f"{path.name} is not a regular file of ours")
    try:
        with private_files.open_private(path, sys.maxsize) as handle:
            info = os.fstat(handle.fileno())
            header = kv_files.read_header(handle, path.name, info.st_size, complete=False)
    except (OSError, kv_files.EntryFileError) as exc:
        raise NotOurs(str(exc)) from None
    return Ours(path, info, header, entry_tokens(path, header, written=written))


def remove(path: Path, ino: int) -> bool:
    """Unlink `path` when it still is the regular file of ours that was proven (inode `ino`);
    anything that took its place (a link, a folder, another file) is left alone."""
    info = private_files.regular_of_ours(path)
    if info is None or info.st_ino != ino:
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


class Proven(NamedTuple):
    """One of our entry files, for the budget (its stat when listed)."""

    path: Path
    ino: int
    nbytes: int
    used: float   # mtime: when it was written or last read (LRU)


class FolderScan:
    """Every model's entry files under kv/ that are provably ours, least recently used first.

    A file's proof (its header) is kept by inode and size, so a listing at
    each stop reads only the headers of files it has not seen."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._proven: dict[Path, tuple[int, int]] = {}
        self.foreign: dict[Path, str] = {}     # what was left alone, and why (said once each)

    def files(self) -> list[Proven]:
        found = []
        for folder in self._folders():
            for name in names(folder):
                if name.endswith(SUFFIX):
                    proven = self._proof(folder / name)
                    if proven is not None:
                        found.append(proven)
        return sorted(found, key=lambda f: f.used)

    def _folders(self) -> list[Path]:
        folders = []
        for name in names(self.root):
            path = self.root / name
            if name == LOCK_NAME:
                continue
            if not is_tier_folder(name):
                self.note(path, "not a folder the tier makes")
                continue
            try:
                if private_files.private_folder(path, create=False):
                    folders.append(path)
            except OSError as exc:  # NotPrivate (a link, another user's, others may write) or gone
                self.note(path, str(exc))
        return folders

    def remember(self, ours: Ours) -> None:
        """A file proven ours elsewhere (the index): its header need not be read again."""
        self._proven[ours.path] = (ours.info.st_ino, ours.info.st_size)

    def _proof(self, path: Path) -> Proven | None:
        info = private_files.regular_of_ours(path)
        if info is not None and self._proven.get(path) == (info.st_ino, info.st_size):
            return Proven(path, info.st_ino, info.st_size, info.st_mtime)
        try:
            ours = prove(path)
        except NotOurs as exc:
            self.note(path, str(exc))
            return None
        self.remember(ours)
        return Proven(path, ours.info.st_ino, ours.info.st_size, ours.info.st_mtime)

    def note(self, path: Path, why: str) -> None:
        """A file or folder the tier leaves alone: said once, counted while it is there."""
        if path not in self.foreign:
            self.foreign[path] = why
            log.warning(
                "prompt cache disk tier: %s left alone (%s); it is never read nor removed", path, why)


def names(folder: Path) -> list[str]:
    """The names in `folder`, sorted; none when it cannot be listed (gone, or not a folder)."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


class BudgetConflict(Exception):
    """Another live worker uses this kv/ folder with another `disk_cache_max`."""


def describe_setting(setting: int) -> str:
    return "auto" if setting == DISK_CACHE_AUTO else format_size(setting)


def share_budget(root: Path, setting: int, wait: float = LOCK_WAIT) -> int:
    """Hold a shared lock on `root/budget.lock` as a user of the folder's one budget, `setting`:
    the descriptor (closing it, or exiting, lets go). The first holder writes its setting;
    a later one with another setting gets BudgetConflict naming both, and holds nothing."""
    fd = _open_lock(root / LOCK_NAME)
    mine = str(setting).encode()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine, 0)
            fcntl.flock(fd, fcntl.LOCK_SH)  # not atomic: another may write its own meanwhile, read below
        except BlockingIOError:
            _shared(fd, wait)
        held = os.pread(fd, 64, 0)
        if held != mine:
            raise BudgetConflict(
                f"another memvisor uses {root} with disk_cache_max = {_setting_text(held)}, this one has "
                f"{describe_setting(setting)}: one folder has one budget (give both the same "
                f"disk_cache_max, or this one its own MEMVISOR_CACHE)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, private_files.FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise private_files.link_refused(path, "a file") from None
        raise
    info = os.fstat(fd)
    problem = private_files.owner_problem(path, info)
    if problem is None and not os.path.samestat(info, os.lstat(path)):
        problem = f"{path} changed while it was opened"
    if problem is not None:
        os.close(fd)
        raise private_files.NotPrivate(problem)
    return fd


def _shared(fd: int, wait: float) -> None:
    """A shared hold, waiting out another worker's moment of exclusive hold (bounded)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise BudgetConflict("the budget's lock stayed held exclusively; another worker is stuck in it") \
                    from None
            time.sleep(0.01)


def _setting_text(raw: bytes) -> str:
    try:
        return describe_setting(int(raw))
    except ValueError:
        return repr(raw.decode(errors="replace"))
