"""The `chat` command's side of the HTTP front door: where it is, one streamed reply, load progress.

`chat` is a client like any other: it sends Ollama's `POST /api/chat` with
`"stream": true` to the running supervisor's front door (its address is in
the runtime dir's endpoints.json), so a model not loaded yet is loaded
through the same admission as any request (SPEC A). While no token has come,
it asks `GET /health?model=ID` for the load's progress to show it.
The reply is read on a thread and handed over piece by piece, so the
terminal stays responsive (progress, Ctrl-C) while the model loads.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from shared.sizes import format_size
from supervisor.wiring.bus import Endpoints, NotRunning, pid_alive

CONNECT_SECONDS = 5.0
WAIT = 0.25  # seconds between two looks at the reply while none has come


class ChatError(RuntimeError):
    """The request failed; the message is one line for the terminal."""


def front_door(runtime_dir: Path) -> str:
    """`http://HOST:PORT` of the supervisor in `runtime_dir` (a wildcard bind is reached on loopback)."""
    try:
        endpoints = Endpoints.load(runtime_dir)
    except NotRunning as exc:
        raise ChatError(f"{exc}: start one with `memvisor serve`") from None
    if not pid_alive(endpoints.pid):
        raise ChatError(f"the supervisor that used {runtime_dir} (pid {endpoints.pid}) is gone: "
                        "start one with `memvisor serve`")
    if not endpoints.http:
        raise ChatError(f"the supervisor in {runtime_dir} serves no HTTP (it was started with --http off)")
    host, _, port = endpoints.http.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)
    return f"http://{host}:{port}"


def _error_of(body: bytes, status: int) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    message = data.get("error") if isinstance(data, dict) else None
    if isinstance(message, dict):  # the OpenAI shape, should a proxy answer
        message = message.get("message")
    return str(message or body[:300].decode("utf-8", "replace") or f"HTTP {status}").splitlines()[0]


class Reply:
    """One streamed answer: pieces of text as they come, read on a thread."""

    def __init__(self, client: httpx.Client, model: str, messages: list[dict[str, str]],
                 options: dict[str, Any]) -> None:
        self.items: queue.Queue[tuple[str, str]] = queue.Queue()
        self.body = {"model": model, "messages": messages, "stream": True, "options": options}
        self.client = client
        self.closed = threading.Event()
        self.response: httpx.Response | None = None
        threading.Thread(target=self._read, name="memvisor-chat", daemon=True).start()

    def close(self) -> None:
        """Stop reading: the connection closes and the server stops the request."""
        self.closed.set()
        response = self.response
        if response is not None:
            response.close()

    def _read(self) -> None:
        try:
            with self.client.stream("POST", "/api/chat", json=self.body) as response:
                self.response = response
                if self.closed.is_set():
                    return
                if response.status_code != 200:
                    self.items.put(("error", _error_of(response.read(), response.status_code)))
                    return
                for line in response.iter_lines():
                    if line.strip():
                        self._line(json.loads(line))
            self.items.put(("end", ""))
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:  # RuntimeError: closed by `close`
            if not self.closed.is_set():
                self.items.put(("error", f"the connection to {self.client.base_url} failed: {exc}"))

    def _line(self, data: dict[str, Any]) -> None:
        if data.get("error"):
            self.items.put(("error", str(data["error"]).splitlines()[0]))
            return
        text = (data.get("message") or {}).get("content") or ""
        if text:
            self.items.put(("text", text))

    def pieces(self) -> Iterator[str | None]:
        """The text as it comes; None every WAIT seconds while nothing has (for a progress line).
        Ends at the end of the reply; ChatError when it failed."""
        while True:
            try:
                kind, value = self.items.get(timeout=WAIT)
            except queue.Empty:
                yield None
                continue
            if kind == "text":
                yield value
            elif kind == "error":
                raise ChatError(value)
            else:
                return


def load_line(client: httpx.Client, model: str) -> str:
    """What the model's load looks like now, in words ("" when it is loaded or unknown)."""
    try:
        response = client.get("/health", params={"model": model}, timeout=2.0)
        ready = response.json()
    except (httpx.HTTPError, ValueError):
        return ""
    state = ready.get("state", "")
    progress = ready.get("progress") or {}
    if state == "unloaded":
        return f"loading {model}..."
    if state != "loading":
        return f"{model}: {state}" if state not in ("ready", "busy") else ""
    done, total = progress.get("bytes", 0), progress.get("estimate_bytes", 0)
    figures = f" {min(100, 100 * done // total)}% ({format_size(done)} of {format_size(total)})" if total else ""
    return f"loading {model}:{figures} {progress.get('elapsed', 0):.0f} s"
