"""A recording reverse proxy: what a real client sent to memvisor, and when the answer began.

The client scripts (`open_webui_run.py`, `lm_eval_run.py`) point the client at this proxy
instead of at memvisor, so the note can say which routes a client calls, with which
content type and which body fields, and how long each answer took to its first byte and
to its end. Bodies pass through unchanged, streamed both ways (an SSE reply reaches the
client as memvisor sends it). Loopback only; runs in a thread of the calling script.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
HEAD = 4096  # bytes of each reply kept in the record, from its start and from its end


@dataclass
class Exchange:
    """One request through the proxy, as the note reports it."""

    method: str
    path: str
    content_type: str
    body: object  # the JSON body (token-id lists shortened), else its length in bytes
    status: int = 0
    first_byte_s: float = 0.0
    total_s: float = 0.0
    reply_bytes: int = 0
    reply_head: str = ""  # the reply's first bytes, as text (what a stream opens with)
    reply_tail: str = ""  # its last bytes (a stream's closing lines: the usage, the stats)
    began: float = field(default_factory=time.time)
    full: object = field(default=None, repr=False)  # the whole JSON body, kept out of dump()


def parse(raw: bytes) -> object:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def summarise_body(raw: bytes) -> object:
    """The JSON body with long lists cut to their first items and length (token-id prompts)."""
    value = parse(raw)
    if value is None:
        return len(raw)

    def cut(v: object) -> object:
        if isinstance(v, list):
            head = [cut(x) for x in v[:3]]
            return head if len(v) <= 3 else [*head, f"... {len(v)} items"]
        if isinstance(v, dict):
            return {k: cut(x) for k, x in v.items()}
        if isinstance(v, str) and len(v) > 200:
            return v[:200] + f"... {len(v)} chars"
        return v

    return cut(value)


class Recorder:
    """`http://127.0.0.1:PORT` forwarding everything to `upstream`; `exchanges` is the record."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self.forward,
                                      methods=["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def forward(self, request: Request) -> StreamingResponse:
        raw = await request.body()
        ex = Exchange(request.method, request.url.path, request.headers.get("content-type", ""),
                      summarise_body(raw) if raw else None, full=parse(raw))
        self.exchanges.append(ex)
        started = time.monotonic()
        client = httpx.AsyncClient(timeout=None)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        upstream = client.build_request(request.method, self.upstream + request.url.path,
                                        params=request.query_params, headers=headers, content=raw)
        reply = await client.send(upstream, stream=True)
        ex.status = reply.status_code

        async def body():
            tail = b""
            try:
                async for chunk in reply.aiter_raw():
                    if not ex.first_byte_s:
                        ex.first_byte_s = round(time.monotonic() - started, 3)
                    if ex.reply_bytes < HEAD:
                        ex.reply_head += chunk[:HEAD - ex.reply_bytes].decode("utf-8", "replace")
                    tail = tail[-HEAD:] + chunk if len(chunk) < HEAD else chunk[-HEAD:]
                    ex.reply_bytes += len(chunk)
                    yield chunk
            finally:
                ex.reply_tail = tail[-HEAD:].decode("utf-8", "replace")
                ex.total_s = round(time.monotonic() - started, 3)
                await reply.aclose()
                await client.aclose()

        out = {k: v for k, v in reply.headers.items() if k.lower() not in HOP}
        return StreamingResponse(body(), status_code=reply.status_code, headers=out)

    def dump(self, *, full: bool = False) -> list[dict]:
        """The record; with `full`, each request's whole JSON body instead of its summary."""
        return [{k: v for k, v in asdict(e).items() if k != "full"} | ({"body": e.full} if full else {})
                for e in self.exchanges]


def shapes(exchanges: list[dict]) -> dict[str, dict]:
    """Per route: how often, the content types, the body fields seen, statuses, slowest first byte."""
    out: dict[str, dict] = {}
    for e in exchanges:
        key = f"{e['method']} {e['path']}"
        row = out.setdefault(key, {"count": 0, "content_types": set(), "fields": set(), "statuses": set(),
                                   "max_first_byte_s": 0.0})
        row["count"] += 1
        row["content_types"].add(e["content_type"] or "-")
        if isinstance(e["body"], dict):
            row["fields"].update(e["body"])
        row["statuses"].add(e["status"])
        row["max_first_byte_s"] = max(row["max_first_byte_s"], e["first_byte_s"])
    return {k: {**v, **{s: sorted(v[s]) for s in ("content_types", "fields", "statuses")}}
            for k, v in out.items()}

