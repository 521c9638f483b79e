"""A pull's files fetched into the Hugging Face cache: resumable, checked, cancellable.

Why not `snapshot_download` alone: huggingface_hub 2.x writes each file to a
name unique to the process and deletes it when the download fails
(huggingface/huggingface_hub#4228), so an interrupted pull (Ctrl-C, a killed
process, an HTTP client that went away) would fetch gigabytes again. Here a
file is fetched into `blobs/<etag>.incomplete` (the name huggingface_hub 0.x
used), which survives, and the next pull resumes it with a Range request,
through huggingface_hub's own `http_get` (which also resumes a connection
dropped within one pull). The finished blob is checked against the digest the
hub gave for it (an LFS file's sha256, a small file's git blob id), renamed
into place, and `hf_hub_download` links it into the snapshot as every user of
the cache expects. The same lock huggingface_hub takes guards each blob, so
two pulls (or a pull and another tool) never write one file at once.

Runs on a thread (the supervisor's loop never waits on the network or a
disk); a `threading.Event` cancels it at the next chunk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import msgspec

from supervisor.models import pulled
from supervisor.models.hub_repo import HubError, Plan, RepoFile, hub_cache, hub_endpoint
from supervisor.models.pulled import Pulled

_ETAG_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID_RE = re.compile(r"^[0-9a-f]{40}$")
HASH_CHUNK = 4 * 1024 * 1024
# huggingface_hub reads a download in chunks of 10 MiB and reports (so we can cancel) once a chunk;
# 1 MiB chunks make a cancel land within a second on a slow link and keep more of an interrupted
# file for the next pull to resume from. Its module setting, read at each download.
PULL_CHUNK = 1024 * 1024

Phase = Literal["pulling", "verifying", "linking"]


class Cancelled(Exception):
    """The pull was cancelled (its client went away, Ctrl-C); what was fetched stays for a resume."""


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """Progress of one file: `done` of `size` bytes in `phase`."""

    file: str
    size: int
    done: int
    phase: Phase
    digest: str = ""  # "sha256:<hex>" when the hub gave one


OnStep = Callable[[Step], None]


def pull(plan: Plan, on_step: OnStep, cancel: threading.Event) -> Pulled:
    """Every file of `plan` into the hub cache, then recorded as pulled (supervisor.models.pulled)."""
    cache, endpoint = hub_cache(), hub_endpoint()
    for file in plan.files:
        _fetch_blob(plan, file, cache, endpoint, on_step, cancel)
    _link(plan, cache, endpoint, on_step)
    entry = pulled.entry_for(plan, cache)
    pulled.add(entry)
    return entry


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def _fetch_blob(plan: Plan, file: RepoFile, cache: Path, endpoint: str, on_step: OnStep,
                cancel: threading.Event) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    if cancel.is_set():
        raise Cancelled()
    url = hf_hub_url(plan.ref.repo, file.name, revision=plan.commit, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    except (OSError, ValueError) as exc:
        raise HubError(f"cannot fetch {file.name} of {plan.ref.repo}: {str(exc).splitlines()[0][:300]}", 502) from None
    etag, size = meta.etag or "", meta.size if meta.size is not None else file.size
    if not _ETAG_RE.match(etag) or size != file.size:
        raise HubError(f"{endpoint} describes {file.name} differently from its listing (etag {etag[:80]!r}, "
                       f"{size} bytes, listed {file.size}): pull again", 502)
    digest = f"sha256:{file.sha256}" if file.sha256 else ""
    blob = repo_folder(cache, plan.ref.repo) / "blobs" / etag
    step = functools.partial(Step, file=file.name, size=size, digest=digest)
    if blob.is_file():
        on_step(step(done=size, phase="pulling"))
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    with _blob_lock(cache, plan.ref.repo, etag, cancel):
        if blob.is_file():  # another pull finished it while we waited
            on_step(step(done=size, phase="pulling"))
            return
        partial = blob.with_name(etag + ".incomplete")
        _download(meta.location, url, partial, size, lambda done: on_step(step(done=done, phase="pulling")), cancel)
        on_step(step(done=0, phase="verifying"))
        _verify(partial, etag, file, lambda done: on_step(step(done=done, phase="verifying")), cancel)
        partial.chmod(_cache_mode(partial.parent))
        os.replace(partial, blob)


def _download(location: str, url: str, partial: Path, size: int, progress: Callable[[int], None],
              cancel: threading.Event) -> None:
    """Append what `partial` lacks; a file that is somehow longer than the blob starts again."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, PULL_CHUNK)
    headers = build_hf_headers()
    if urlsplit(location).netloc != urlsplit(url).netloc:  # a CDN's signed URL: no hub token to it
        headers.pop("authorization", None)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "ab") as out:
        resume = os.fstat(fd).st_size
        if resume > size:
            out.truncate(0)
            resume = 0
        meter = functools.partial(_Meter, report=progress, cancel=cancel)
        try:
            http_get(location, out, resume_size=resume, headers=headers, expected_size=size,
                     tqdm_class=meter)  # type: ignore[arg-type]
        except Cancelled:
            raise
        except (OSError, ValueError) as exc:
            raise HubError(f"download of {url.rsplit('/', 1)[-1]} failed: {str(exc).splitlines()[0][:300]} "
                           "(pull again: it resumes where it stopped)", 502) from None


class _Meter:
    """What `http_get` takes for a progress bar: it counts bytes, reports them, and stops the
    download (Cancelled) once the pull is cancelled."""

    def __init__(self, *, report: Callable[[int], None], cancel: threading.Event, initial: int = 0,
                 **_bar: object) -> None:
        self.report, self.cancel, self.done = report, cancel, initial
        report(initial)

    def __enter__(self) -> "_Meter":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: float | None = 1) -> None:
        if self.cancel.is_set():
            raise Cancelled()
        self.done += int(n or 0)
        self.report(self.done)

    def close(self) -> None:
        pass


def _verify(partial: Path, etag: str, file: RepoFile, progress: Callable[[int], None],
            cancel: threading.Event) -> None:
    """The bytes are the ones the hub named: an LFS file's sha256, a git file's blob id.
    A file that fails is removed (it can never become right by resuming)."""
    sha256 = file.sha256 or (etag if _SHA256_RE.match(etag) else "")
    digest = hashlib.sha256() if sha256 else hashlib.sha1() if _GIT_OID_RE.match(etag) else None
    if digest is None:
        return  # a mirror's own etag: nothing to check against
    if not sha256:
        digest.update(f"blob {file.size}\0".encode())
    done = 0
    with open(partial, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            if cancel.is_set():
                raise Cancelled()
            digest.update(chunk)
            done += len(chunk)
            progress(done)
    if digest.hexdigest() != (sha256 or etag):
        partial.unlink(missing_ok=True)
        raise HubError(f"{file.name}: the bytes fetched do not match the hub's digest; removed, pull again", 502)


@contextlib.contextmanager
def _blob_lock(cache: Path, repo: str, etag: str, cancel: threading.Event) -> Iterator[None]:
    """huggingface_hub's own lock for this blob, waited for in steps so a cancel is heard."""
    from filelock import FileLock, Timeout

    path = cache / ".locks" / repo_folder(cache, repo).name / f"{etag}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    while True:
        if cancel.is_set():
            raise Cancelled()
        try:
            lock.acquire(timeout=1.0)
            break
        except Timeout:
            continue
    try:
        yield
    finally:
        lock.release()


def _cache_mode(folder: Path) -> int:
    """The mode a new file gets in `folder` under this process's umask (as huggingface_hub
    finds it: a probe file, since reading the umask would change it for every thread)."""
    probe = folder / f".mode-probe-{os.getpid()}-{threading.get_ident()}"
    probe.touch()
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink(missing_ok=True)


def _link(plan: Plan, cache: Path, endpoint: str, on_step: OnStep) -> None:
    """The blobs linked into `snapshots/<commit>/` by huggingface_hub, and `refs/<revision>`."""
    from huggingface_hub import hf_hub_download

    for file in plan.files:
        on_step(Step(file=file.name, size=file.size, done=file.size, phase="linking"))
        try:
            hf_hub_download(plan.ref.repo, file.name, revision=plan.commit, cache_dir=cache, endpoint=endpoint)
        except (OSError, ValueError) as exc:
            raise HubError(f"cannot link {file.name} into the cache: {str(exc).splitlines()[0][:300]}", 502) from None
    if plan.ref.revision != plan.commit:
        _write_ref(repo_folder(cache, plan.ref.repo), plan.ref.revision, plan.commit)


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """`refs/<revision>` names the commit (what discovery and huggingface_hub read), replaced whole."""
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)
