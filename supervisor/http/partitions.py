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
key what it wrote for it: it is kept in `$MEMVISOR_CACHE/keys/partition.secret`
(beside the BLAS copy and `kv/`), 32 random bytes, 0600 in a 0700 folder,
created without following a link and checked (owner, mode, size) before each
use by shared/private_files.py, as the disk tier's files are. A folder that
another user owns or may write, or a file that fails the check, is not used: the
server serves with a secret of this run only (every key keeps its own partition,
the disk tier just cannot serve keys across a restart), and says so once.

The current caller's partition travels with the request (`serving` around the
handler, `current` where the Generate is sent: http/job.py `open_stream`), as
routing.py's record does, so every API's door gets it without a change of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from shared import private_files
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
    return private_files.cache_root() / SECRET_FOLDER / SECRET_FILE


class SecretRefused(Exception):
    """The secret's file is not one this server can use; the message says why."""


def server_secret(path: Path | None = None) -> bytes:
    """The per-server secret from `path` (made on first use); one of this run only when refused."""
    path = path or secret_path()
    try:
        return read_or_create(path)
    except (OSError, SecretRefused) as exc:  # NotPrivate is an OSError: it names the folder and what to do
        log.warning("API keys: the prompt-cache partition secret %s is not used (%s); this run uses one of "
                    "its own, so the disk tier serves no key what an earlier run wrote", path, exc)
        return secrets.token_bytes(SECRET_BYTES)


def read_or_create(path: Path) -> bytes:
    """`path`'s secret, made first if there is none, in folders checked private from the caches
    folder down (shared/private_files.py, as the disk tier's). A secret others could read is
    replaced: the partitions it named are as good as known."""
    private_files.private_path(path.parent.parent, path.parent.name)
    info = private_files.regular_of_ours(path)
    if info is not None and stat.S_IMODE(info.st_mode) & 0o077:
        log.warning("API keys: %s was readable by others (mode %04o); a new secret replaces it (what the "
                    "disk tier held for each key is not read again)", path, stat.S_IMODE(info.st_mode))
        private_files.write_private(path, secrets.token_bytes(SECRET_BYTES))
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    _create(path, secrets.token_bytes(SECRET_BYTES))
    return _read(path)


def _read(path: Path) -> bytes:
    with private_files.open_private(path, SECRET_BYTES) as handle:  # no link, ours, nobody else writes it
        data = handle.read(SECRET_BYTES + 1)
    if len(data) != SECRET_BYTES:
        raise SecretRefused(f"{path} holds {len(data)} bytes, not {SECRET_BYTES}")
    return data


def _create(path: Path, secret: bytes) -> None:
    """Written whole under a private name, then linked into place: a reader never sees half a
    secret, and of two servers starting at once the first link wins (the other reads it)."""
    tmp = private_files.temporary_name(path)
    fd = private_files.create_private(tmp)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(secret)
            os.fsync(out.fileno())
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)  # ours: create_private made it


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
