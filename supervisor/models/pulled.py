"""What `pull` fetched: a small record, the models it adds to the catalogue, and `rm`.

Why a record rather than serving the whole Hugging Face cache: that cache
holds whatever any tool downloaded (transformers' checkpoints, datasets), and
each would become a model that fails to load. A pulled model is served
without a config entry (supervisor.models.discovery adds it, after `[[models]]`,
before the `models_dirs` scan; an id taken by either stays theirs), and `rm`
deletes only what the record names: never a model folder of `[[models]]` or
`models_dirs`.

The record is `$MEMVISOR_CACHE/pulled.json` (default
`~/.cache/memvisor/pulled.json`): written whole to a new file (O_EXCL,
O_NOFOLLOW, 0600) in a 0700 folder and renamed into place, under a lock so a
CLI pull and the supervisor's never lose each other's entry. Read back, it is
input like any file: a symlink, a file of another user or one others may
write is refused, and each entry's repo, commit and file name are checked
before any path is built from them.

Deleting goes through huggingface_hub's cache API (`scan_cache_dir`,
`delete_revisions`): the snapshots of the pulled repo in the cache it was
pulled into, and with them the blobs no other revision uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from shared.sizes import format_size

if TYPE_CHECKING:
    from supervisor.models.hub_repo import Plan

log = logging.getLogger("memvisor.pulled")

RECORD_NAME = "pulled.json"
RECORD_MAX_BYTES = 1024 * 1024
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class RecordError(RuntimeError):
    """The record cannot be trusted or written; the message says why."""


class Pulled(msgspec.Struct, frozen=True, kw_only=True):
    """One pulled model: where its snapshot lies and what it is served as."""

    id: str
    repo: str
    revision: str
    commit: str
    kind: Literal["mlx", "gguf"]
    cache: str            # the hub cache it was pulled into (absolute)
    file: str = ""        # a GGUF model's file inside the snapshot
    pulled_at: float = 0.0

    @property
    def snapshot(self) -> Path:
        return Path(self.cache) / ("models--" + self.repo.replace("/", "--")) / "snapshots" / self.commit

    @property
    def path(self) -> Path:
        """What the catalogue serves: the snapshot folder, or the GGUF file in it."""
        return self.snapshot / self.file if self.file else self.snapshot


def entry_for(plan: Plan, cache: Path) -> Pulled:
    return Pulled(id=plan.ref.model_id, repo=plan.ref.repo, revision=plan.ref.revision, commit=plan.commit,
                  kind=plan.kind, cache=str(cache.expanduser().resolve()), file=plan.gguf, pulled_at=time.time())


class Record(msgspec.Struct, kw_only=True):
    version: int = 1
    models: list[Pulled] = msgspec.field(default_factory=list)


def record_path() -> Path:
    """Beside the prompt cache's disk tier and the BLAS copy, under MEMVISOR_CACHE."""
    from shared.probe import blas_plan

    return blas_plan.cache_dir().parent / RECORD_NAME


def problem(entry: Pulled) -> str | None:
    """Why an entry read back cannot be used, or None."""
    from supervisor.config_checks import check_model_id
    from supervisor.models.hub_repo import RefError, parse_ref

    try:
        ref = parse_ref(entry.repo, entry.file)
    except RefError as exc:
        return str(exc)
    if ref.repo != entry.repo or not _COMMIT_RE.match(entry.commit) or not os.path.isabs(entry.cache):
        return "its repo, commit or cache folder is malformed"
    return check_model_id(entry.id)


def read() -> list[Pulled]:
    """The usable entries (a malformed one is skipped with a warning); [] when there is no record."""
    path = record_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc}); refused") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o022:
            raise RecordError(f"{path}: not a regular file of this user that only they may write; refused")
        raw = handle.read(RECORD_MAX_BYTES + 1)
    if len(raw) > RECORD_MAX_BYTES:
        raise RecordError(f"{path}: larger than {RECORD_MAX_BYTES} bytes; refused")
    try:
        record = msgspec.json.decode(raw, type=Record)
    except msgspec.DecodeError as exc:
        raise RecordError(f"{path}: unreadable ({exc}); refused") from None
    usable = []
    for entry in record.models:
        why = problem(entry)
        if why is None:
            usable.append(entry)
        else:
            log.warning("%s: entry %r skipped: %s", path, entry.id[:80], why)
    return usable


@contextlib.contextmanager
def _locked() -> Iterator[Path]:
    from filelock import FileLock

    from supervisor.wiring.runtime import ensure_private_dir

    path = record_path()
    ensure_private_dir(path.parent)
    with FileLock(str(path.with_name(RECORD_NAME + ".lock")), timeout=30, mode=0o600):
        yield path


def _write(path: Path, models: list[Pulled]) -> None:
    tmp = path.with_name(f".{RECORD_NAME}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(msgspec.json.format(msgspec.json.encode(Record(models=models))))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add(entry: Pulled) -> None:
    """Record `entry` (replacing one of the same id)."""
    with _locked() as path:
        kept = [m for m in read() if m.id != entry.id]
        _write(path, [*kept, msgspec.structs.replace(entry, pulled_at=entry.pulled_at or time.time())])


def find(name: str, models: list[Pulled]) -> Pulled | None:
    """The entry `name` means: its id (Ollama's `:latest` tag allowed), or its repo when one entry has it."""
    name = name.strip().removesuffix(":latest")
    for prefix in ("hf.co/", "huggingface.co/"):
        name = name.removeprefix(prefix)
    exact = next((m for m in models if m.id == name), None)
    if exact is not None:
        return exact
    same_repo = [m for m in models if m.repo == name]
    return same_repo[0] if len(same_repo) == 1 else None


def served() -> tuple[list[Pulled], list[str]]:
    """The pulled models whose files are still there, and warnings for the others."""
    try:
        models = read()
    except RecordError as exc:
        return [], [str(exc)]
    present, warnings = [], []
    for m in models:
        if m.path.exists():
            present.append(m)
        else:
            warnings.append(f"pulled model {m.id}: {m.path} is gone (pull it again, or `rm {m.id}`)")
    return present, warnings


def forget(entry: Pulled) -> list[Pulled]:
    """Take `entry` out of the record; the entries left."""
    with _locked() as path:
        left = [m for m in read() if m.id != entry.id]
        _write(path, left)
    return left


def delete_files(entry: Pulled, left: list[Pulled]) -> str:
    """The snapshots of `entry`'s repo in its cache, through huggingface_hub's cache API, unless
    another pulled model still lives there; what was done, in words. Blocking: off the loop."""
    sharing = [m.id for m in left if m.repo == entry.repo and m.cache == entry.cache]
    if sharing:
        return f"its files stay: {', '.join(sharing)} still use(s) the same snapshot"
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    _forget_import(entry)
    try:
        info = scan_cache_dir(entry.cache)
    except CacheNotFound:
        return "its files were already gone"
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == entry.repo), None)
    if repo is None:
        return "its files were already gone"
    strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
    strategy.execute()
    return f"freed {format_size(strategy.expected_freed_size)} in {entry.cache}"


def _forget_import(entry: Pulled) -> None:
    """A pulled GGUF's imported MLX folder (ours: under memvisor's cache, named for that file)."""
    if not entry.file or not entry.path.exists():
        return
    import shutil

    from supervisor.models.gguf_import_cache import cache_folder

    folder = cache_folder(entry.path)
    if folder.is_dir() and not folder.is_symlink() and folder.stat().st_uid == os.getuid():
        shutil.rmtree(folder, ignore_errors=True)
