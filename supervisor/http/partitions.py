"""Whose prompt cache a request may use: one partition per API key (SPEC H7 as proposed).

With `[supervisor] api_keys`, the workers' prompt caches (memory and disk) are
split by key, or `cached_tokens` would tell key B, guess by guess, which system
prompt key A sent (a "vault code" came back 145 of 146 tokens cached when right,
55-57 when wrong). The supervisor names each caller's partition and sends it with
every `Generate`; workers only ever compare it.

The name is a keyed hash of the key: HMAC-SHA256 under a per-server secret,
truncated to 128 bits, in hex. Never the key itself (it lands in file names and
metadata on disk), and not a plain hash either: without the secret, a name read
off the disk tier cannot be checked against guessed keys. The admin token, which
also opens /v1, is a key like the others: its own partition. Without keys there
is one partition (`SHARED_PARTITION`) and nothing here runs.

The secret must outlive a restart, or the disk tier would never again serve a
key what it wrote for it: it is kept in `<caches root>/keys/partition.secret`
(beside the BLAS copy and `kv/`, shared.probe.blas.cache_dir's parent), 32
random bytes, 0600 in a 0700 folder, created without following a link and
checked (owner, mode, size) before each use. A root or folder that another user
owns or may write, or a file that fails the check, is not used: the server
serves with a secret of this run only (every key keeps its own partition, the
disk tier just cannot serve keys across a restart), and says so once.

The current caller's partition travels with the request (`serving` around the
handler, `current` where the Generate is sent: http/job.py `open_stream`), as
routing.py's record does, so every API's door gets it without a change of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from shared.probe import blas as found
from shared.protocol import SHARED_PARTITION

log = logging.getLogger("memvisor.http")

SECRET_BYTES = 32
PARTITION_BYTES = 16  # 128 bits of the HMAC: no two keys meet by chance, short in a file name
SECRET_FOLDER = "keys"
SECRET_FILE = "partition.secret"


def partition_id(secret: bytes, key: str) -> str:
    """The partition of whoever holds `key`: stable for a secret, unrelated across secrets."""
    return hmac.new(secret, key.encode(), hashlib.sha256).digest()[:PARTITION_BYTES].hex()


def secret_path() -> Path:
    return found.cache_dir().parent / SECRET_FOLDER / SECRET_FILE


class SecretRefused(Exception):
    """The secret's folder or file is not provably ours and private; the message says why."""


def server_secret(path: Path | None = None) -> bytes:
    """The per-server secret from `path` (made on first use); one of this run only when refused."""
    path = path or secret_path()
    try:
        return read_or_create(path)
    except (OSError, SecretRefused) as exc:
        log.warning("API keys: the prompt-cache partition secret %s is not used (%s); this run uses one of "
                    "its own, so the disk tier serves no key what an earlier run wrote", path, exc)
        return secrets.token_bytes(SECRET_BYTES)


# ---------------------------------------------------------------------------
# the private folder and file (kept small: a shared module for private files may replace them)


def read_or_create(path: Path) -> bytes:
    """`path`'s secret, written first if there is none; SecretRefused when it is not ours alone."""
    private_folder(path.parent.parent, exact=False)
    private_folder(path.parent, exact=True)
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    _create(path, secrets.token_bytes(SECRET_BYTES))
    return _read(path)


def private_folder(folder: Path, *, exact: bool) -> None:
    """`folder` made 0700 when missing; refused when it is a link, not ours, or writable by
    group or others (`exact`: no group/other bits at all)."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    loose = stat.S_IMODE(info.st_mode) & (0o077 if exact else 0o022)
    if not stat.S_ISDIR(info.st_mode):
        raise SecretRefused(f"{folder} is not a folder (a link is not followed)")
    if info.st_uid != os.geteuid():
        raise SecretRefused(f"{folder} belongs to uid {info.st_uid}, not this server's user")
    if loose:
        raise SecretRefused(f"{folder} has mode {stat.S_IMODE(info.st_mode):o}: others may change it")


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise SecretRefused(f"{path} is not a file of this user's with mode 600")
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise SecretRefused(f"{path} holds {len(data)} bytes, not {SECRET_BYTES}")
    return data


def _create(path: Path, secret: bytes) -> None:
    """Written whole under a private name, then linked into place: a reader never sees half a
    secret, and of two servers starting at once the first link wins (the other reads it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
    finally:
        os.unlink(tmp)


# ---------------------------------------------------------------------------
# the caller's partition, for the length of its request


_current: contextvars.ContextVar[str] = contextvars.ContextVar("memvisor_partition", default=SHARED_PARTITION)


@contextlib.contextmanager
def serving(partition: str) -> Iterator[None]:
    """`partition` is the current request's while the block runs (http/auth.py `ApiKeys.required`)."""
    token = _current.set(partition)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> str:
    """The partition of the request being served (SHARED_PARTITION outside one, or without keys)."""
    return _current.get()
