"""A small Hugging Face hub on loopback, for the pull tests (no tests here; no hub is reachable).

It answers what huggingface_hub 2.x asks when `pull` runs it for real:

- `GET /api/models/{repo}[/revision/{rev}]` (`HfApi.model_info`, with `?blobs=true`): the
  commit and every file with its size, blob id and LFS digest;
- `HEAD /{repo}/resolve/{rev}/{file}` (`get_hf_file_metadata`): `X-Repo-Commit`, `ETag`
  (an LFS file's sha256, else its git blob id, as the hub sends them), `Content-Length`;
- `GET` of the same with `Range: bytes=A-[B]` (206 and `Content-Range`), for a resumed
  download and for a GGUF header read before a pull.

With `cdn=True` an LFS file's resolve URL answers as the real hub's does: 302 to a storage host
(the same server under the name `localhost`) with `X-Linked-Etag` and `X-Linked-Size`.

Errors carry the hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`)
so huggingface_hub raises its own exceptions. The server counts the bytes of file data it
sent per file, logs each request with its Range header, can drop a connection part-way
through a file once (`drop_once`), send slowly (`bytes_per_second`), and want a token.
A `Virtual` file has a size and a head but no stored body (zeros are sent): a model far
larger than this machine costs nothing to list.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf")
CHUNK = 256 * 1024


class Virtual:
    """A file of `size` bytes: `head`, then zeros."""

    def __init__(self, size: int, head: bytes = b"") -> None:
        self.size, self.head = size, head

    def read(self, start: int, end: int) -> bytes:
        head = self.head[start:end]
        return head + bytes(max(0, end - max(start, len(self.head))))


class Repo:
    def __init__(self, name: str) -> None:
        self.name = name
        self.files: dict[str, bytes | Virtual] = {}

    @property
    def commit(self) -> str:
        digest = hashlib.sha1(self.name.encode())
        for path in sorted(self.files):
            digest.update(path.encode() + self.etag(path).encode())
        return digest.hexdigest()

    def size(self, path: str) -> int:
        body = self.files[path]
        return body.size if isinstance(body, Virtual) else len(body)

    def lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def etag(self, path: str) -> str:
        body = self.files[path]
        if isinstance(body, Virtual):
            return hashlib.sha256(f"virtual {path} {body.size}".encode()).hexdigest()
        if self.lfs(path):
            return hashlib.sha256(body).hexdigest()
        return hashlib.sha1(f"blob {len(body)}\0".encode() + body).hexdigest()

    def read(self, path: str, start: int, end: int) -> bytes:
        body = self.files[path]
        return body.read(start, end) if isinstance(body, Virtual) else body[start:end]

    def listing(self) -> dict:
        siblings = []
        for path in sorted(self.files):
            entry: dict = {"rfilename": path, "size": self.size(path), "blobId": hashlib.sha1(path.encode()).hexdigest()}
            if self.lfs(path):
                entry["lfs"] = {"size": self.size(path), "sha256": self.etag(path), "pointerSize": 134}
            siblings.append(entry)
        return {"id": self.name, "modelId": self.name, "sha": self.commit, "private": False, "siblings": siblings}


class FakeHub:
    """The server and what it saw. `with FakeHub() as hub:`; `hub.url` is its HF_ENDPOINT."""

    def __init__(self, token: str = "", cdn: bool = False) -> None:
        self.repos: dict[str, Repo] = {}
        self.token = token
        # as the real hub: an LFS file's resolve URL answers 302 to a storage host (here the same
        # server under the name `localhost`), with X-Linked-Etag and X-Linked-Size
        self.cdn = cdn
        self.cdn_authorization: list[str] = []  # the Authorization header each storage request carried
        self.sent: Counter[str] = Counter()       # "repo/file" -> bytes of file data sent
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header or "")
        self.drops: dict[str, int] = {}           # "repo/file" -> drop the connection after this many bytes, once
        self.bytes_per_second = 0                  # 0: as fast as it goes
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_folder(self, repo: str, folder: Path) -> Repo:
        """Every file of `folder` (top level) as the repo's files."""
        entry = self.repos.setdefault(repo, Repo(repo))
        for path in sorted(folder.iterdir()):
            if path.is_file():
                entry.files[path.name] = path.read_bytes()
        return entry

    def add_file(self, repo: str, name: str, body: bytes | Virtual) -> Repo:
        entry = self.repos.setdefault(repo, Repo(repo))
        entry.files[name] = body
        return entry

    def drop_once(self, repo: str, name: str, after: int) -> None:
        self.drops[f"{repo}/{name}"] = after

    def ranges(self, name: str) -> list[str]:
        """The Range headers of the GETs of files called `name`."""
        return [r for method, path, r in self.requests if method == "GET" and path.endswith("/" + name) and r]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    api = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")
    resolve = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
    cdn = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<file>.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(head=False)

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def _answer(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests.append((self.command, path, self.headers.get("Range", "")))
            if (m := cdn.match(path)) and hub.cdn:
                with hub.lock:
                    hub.cdn_authorization.append(self.headers.get("Authorization", ""))
                return self._file(m["repo"], "main", m["file"], head, stored=True)
            if hub.token and self.headers.get("Authorization", "") != f"Bearer {hub.token}":
                return self._error(401, "RepoNotFound", "Invalid username or password.")
            if (m := api.match(path)) and not head:
                return self._listing(m["repo"], unquote(m["rev"] or "main"))
            if m := resolve.match(path):
                return self._file(m["repo"], unquote(m["rev"]), m["file"], head)
            self._error(404, "", "no such route")

        def _repo(self, name: str, rev: str) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if rev not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", "Invalid rev id", commit="")
                return None
            return repo

        def _listing(self, name: str, rev: str) -> None:
            repo = self._repo(name, rev)
            if repo is not None:
                self._send(200, json.dumps(repo.listing()).encode(), {"Content-Type": "application/json"})

        def _file(self, name: str, rev: str, file: str, head: bool, stored: bool = False) -> None:
            repo = self._repo(name, rev)
            if repo is None:
                return
            if file not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
            size = repo.size(file)
            if hub.cdn and repo.lfs(file) and not stored:
                port = hub.server.server_address[1]
                return self._send(302, b"", {"Location": f"http://localhost:{port}/cdn/{repo.name}/{file}",
                                             "X-Repo-Commit": repo.commit, "X-Linked-Etag": f'"{repo.etag(file)}"',
                                             "X-Linked-Size": str(size), "ETag": '"pointer"'})
            start, end = 0, size
            status = 200
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(file)}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")) if not head else None
            if wanted:
                start, end = int(wanted[1]), min(size, int(wanted[2]) + 1 if wanted[2] else size)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            headers["Content-Length"] = str(end - start if not head else size)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self._body(repo, file, start, end)

        def _body(self, repo: Repo, file: str, start: int, end: int) -> None:
            key = f"{repo.name}/{file}"
            with hub.lock:
                drop = hub.drops.pop(key, None)
            position = start
            while position < end:
                step = min(CHUNK, end - position)
                if drop is not None and position - start + step >= drop:
                    step = max(0, drop - (position - start))
                    self._write(repo, file, key, position, step)
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # mid-file, as a dropped network would
                    return
                self._write(repo, file, key, position, step)
                position += step
                if hub.bytes_per_second:
                    time.sleep(step / hub.bytes_per_second)

        def _write(self, repo: Repo, file: str, key: str, position: int, step: int) -> None:
            self.wfile.write(repo.read(file, position, position + step))
            with hub.lock:
                hub.sent[key] += step

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers)

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


# ---------------------------------------------------------------------------
# GGUF files for the hub to serve (the header is what a pull reads first)

_GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
         "Q6_K": (14, 256, 210)}


def gguf_header(tensors: list[tuple[str, tuple[int, ...], str]], name: str = "tiny") -> tuple[bytes, int]:
    """A GGUF v3 header (llama metadata, the given tensors) and the bytes of tensor data it declares."""

    def text(value: str) -> bytes:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw

    meta = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    meta += text("general.name") + struct.pack("<I", 8) + text(name)
    infos, offset = b"", 0
    for tensor, shape, kind in tensors:
        type_id, block, width = _GGML[kind]
        elements = 1
        for dim in shape:
            elements *= dim
        infos += text(tensor) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        infos += struct.pack("<IQ", type_id, offset)
        offset += -(-(elements // block * width) // 32) * 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 2) + meta + infos
    return head + bytes(-len(head) % 32), offset


# ---------------------------------------------------------------------------
# a supervisor that serves what is pulled


def pull_server(config, runtime_dir: Path):
    """A LiveServer (tests/http_harness.py) whose reload re-reads the pull record, as `serve`'s
    does (`serve` rebuilds its config through supervisor.models.discovery.with_discovered)."""
    from supervisor.arbiter import Arbiter
    from supervisor.models.discovery import with_discovered
    from tests.http_harness import LiveServer

    live = LiveServer(config, runtime_dir)
    live.arbiter = Arbiter(with_discovered(config)[0], runtime_dir, max_workers=8, http=True,
                           reload_config=lambda: with_discovered(config)[0])
    return live
