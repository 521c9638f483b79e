"""The caches folder is ours and private (SPEC H5.3): the checks every folder and file in it passes.

Why: `$MEMVISOR_CACHE` (default `~/.cache/memvisor`) holds a conversation's
KV (the prompt cache's disk tier, `kv/`) and a library every Linux worker
loads (the renamed OpenBLAS copy, `blas/`). A folder another local user
created first, or one others may write, let that user read a conversation's
tokens and replace the library with their own, whose constructor then ran in
the next worker. So, from the root down:

- a folder is created 0700; an existing one must be a real folder (never a
  symbolic link: checked on a descriptor opened O_NOFOLLOW|O_DIRECTORY),
  owned by this process's user and writable by nobody else. One of ours at
  0755 (earlier versions made them so) is tightened to 0700, said once in the
  log; anything else is refused (`NotPrivate`), and the caller falls back:
  the disk tier off, MLX's own BLAS; the server still serves.
- a file is created with O_CREAT|O_EXCL|O_NOFOLLOW at 0600 under a temporary
  name and renamed into place, so a link planted at that name is never
  followed and a reader never sees half a file.
- a file is read through `shared.modelinfo.open_regular` with O_NOFOLLOW and
  the same owner/writers rule, checked on the descriptor it reads.

This module never imports MLX: the supervisor's `probe` reads the BLAS plan
through it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

from shared.modelinfo import FileRefused, file_kind, open_regular

log = logging.getLogger("memvisor.private_files")

CACHE_ENV = "MEMVISOR_CACHE"
FOLDER_MODE = 0o700
FILE_MODE = 0o600
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
TMP_MARK = ".tmp-"   # NAME.tmp-PID: a write under way (or abandoned by a process that died)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_tightened: set[str] = set()   # folders this process made 0700 (said once each)


class NotPrivate(FileRefused):
    """A folder or file of the caches folder we do not trust; the message names it, says why and
    what to do."""


def cache_root() -> Path:
    """`$MEMVISOR_CACHE`, else `$XDG_CACHE_HOME/memvisor`, else `~/.cache/memvisor`."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memvisor")
    return Path(root)


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owner_problem(path: str | os.PathLike[str], info: os.stat_result) -> str | None:
    """Why `path` (its stat) is not ours alone: another user's, or writable by group or others."""
    if info.st_uid != os.geteuid():
        return (f"{path} is owned by {_owner(info.st_uid)}, not by this server's user ({_owner(os.geteuid())}); "
                f"remove it, or set {CACHE_ENV} to a folder of your own")
    if info.st_mode & OTHERS_WRITE:
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit)
        return (f"{path} is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"if it is yours alone, `chmod 700` it (0600 for a file), or set {CACHE_ENV} elsewhere")
    return None


def link_refused(path: Path, what: str) -> NotPrivate:
    """The refusal of `path`, found where `what` was expected (a link, most often)."""
    try:
        kind = file_kind(os.lstat(path).st_mode)
    except OSError:
        kind = "changing under us"
    return NotPrivate(f"{path} is {kind}, not {what}; memvisor follows no links in its caches folder: "
                      f"remove it, or point {CACHE_ENV} at a real folder")


def private_folder(path: Path, *, create: bool = True) -> bool:
    """`path` checked as a folder of ours that nobody else can write; True when it exists.

    Created 0700 when missing (with `create`; its parents, above the caches
    folder, as the system makes them). Raises NotPrivate for a symbolic
    link, another user's folder or one others may write."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, FOLDER_MODE)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return False
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise link_refused(path, "a folder") from None
        raise
    try:
        info = os.fstat(fd)
        problem = owner_problem(path, info)
        if problem is not None:
            raise NotPrivate(problem)
        if stat.S_IMODE(info.st_mode) & 0o077:  # ours, readable by others: an earlier version's 0755
            os.fchmod(fd, FOLDER_MODE)
            if str(path) not in _tightened:
                _tightened.add(str(path))
                log.warning("%s was readable by others (mode %04o); made 0700: the caches folder holds "
                            "conversations", path, stat.S_IMODE(info.st_mode))
    finally:
        os.close(fd)
    return True


def private_path(root: Path, *parts: str, create: bool = True) -> Path:
    """`root/parts...`, every folder from `root` down checked (and made, with `create`) by
    `private_folder`; FileNotFoundError when one is missing and not to be made."""
    folder = root
    for step in (None, *parts):
        folder = folder if step is None else folder / step
        if not private_folder(folder, create=create):
            raise FileNotFoundError(errno.ENOENT, "no such folder", str(folder))
    return folder


def _nofollow_refused(path: Path, exc: OSError) -> OSError:
    """A link where a file was expected says so; other errors stay what they are."""
    return link_refused(path, "a file") if exc.errno == errno.ELOOP else exc


def open_private(path: Path, max_bytes: int) -> BinaryIO:
    """`path` opened for reading: a regular file (never through a link) of ours that nobody else
    can write, of at most `max_bytes`. One readable by others is made 0600 (ours: an earlier
    version wrote 0644)."""
    try:
        handle = open_regular(path, max_bytes, flags=_NOFOLLOW, check=lambda info: owner_problem(path, info))
    except FileRefused as exc:
        raise NotPrivate(str(exc)) from None
    except OSError as exc:
        raise _nofollow_refused(path, exc) from None
    mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
    if mode & 0o077:
        os.fchmod(handle.fileno(), mode & 0o700)
    return handle


def create_private(path: Path) -> int:
    """A new file at `path` for writing, 0600, never through a link and never over anything
    that is there (FileExistsError then, a planted link included)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, FILE_MODE)
    except OSError as exc:
        raise _nofollow_refused(path, exc) from None


def temporary_name(path: Path) -> Path:
    """Where a write of `path` goes before its rename: `NAME.tmp-PID` beside it."""
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


def write_private(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """`data` as the whole of `path`: written to a fresh temporary file of ours, then renamed
    over `path` (a reader sees the old file or the new one, never half of one)."""
    tmp = temporary_name(path)
    fd = create_private(tmp)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            os.fchmod(out.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # ours: create_private made it
        raise


def descriptor_path(fd: int) -> str | None:
    """A path that opens the very file `fd` holds (`/proc/self/fd/N`, macOS's `/dev/fd/N`), for
    a loader that takes a path (dlopen, MLX's reader): what was checked is what is read. None
    where neither is mounted."""
    for path in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
        if os.path.exists(path):
            return path
    return None


def regular_of_ours(path: Path) -> os.stat_result | None:
    """`path`'s lstat when it is a regular file (not a link) of ours that nobody else can write;
    None for anything else (missing included)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or owner_problem(path, info) is not None:
        return None
    return info
