"""A lean streaming client for the engine benchmarks: one POST, its SSE events timed as they land.

Why not httpx: on the 2-core machine the benchmark's own client shares the
cores with the server it measures, and httpx's streaming path cost ~150 us of
CPU per token (more than the supervisor's ~100), so a fast server looked slow
partly because the client was. This one reads the socket with asyncio, takes
chunked transfer encoding apart (uvicorn) or reads to EOF (mlx_lm.server's
HTTP/1.0 replies), and decodes each event with msgspec.
Both servers get the same client.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import msgspec


class Stream:
    """One request's times (perf_counter) and counts."""

    __slots__ = ("sent", "first", "last", "chunks", "tokens", "times")

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first = 0.0
        self.last = 0.0
        self.chunks = 0   # SSE events that carried text
        self.tokens = 0   # completion tokens, from the usage event (else the chunks)
        self.times: list[float] = []  # when each text event landed


class _Dechunker:
    """HTTP/1.1 chunked transfer encoding, taken apart incrementally."""

    def __init__(self) -> None:
        self.buffer = b""
        self.left = 0      # data bytes still to read of the current chunk
        self.crlf = False  # the CRLF after a chunk's data is still to skip
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buffer += data
        out = []
        while not self.done:
            if self.left:
                take = self.buffer[: self.left]
                out.append(take)
                self.buffer = self.buffer[len(take):]
                self.left -= len(take)
                if self.left:
                    break
                self.crlf = True
            if self.crlf:
                if len(self.buffer) < 2:
                    break
                self.buffer, self.crlf = self.buffer[2:], False
            line_end = self.buffer.find(b"\r\n")
            if line_end < 0:
                break
            self.left = int(self.buffer[:line_end].split(b";")[0], 16)
            self.buffer = self.buffer[line_end + 2:]
            self.done = self.left == 0
        return b"".join(out)


_events = msgspec.json.Decoder()


async def stream_completion(url: str, body: dict) -> Stream:
    """POST `body` to `url` and time its SSE text events; raises on a non-200 reply."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = msgspec.json.encode(body)
    s = Stream()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"200":
            raise RuntimeError(f"{url}: HTTP {status.decode()}: {(head + await reader.read())[:300]!r}")
        chunked = b"transfer-encoding: chunked" in head.lower()
        dechunk = _Dechunker() if chunked else None
        pending = b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if dechunk is not None:
                data = dechunk.feed(data)
            now = time.perf_counter()
            events = (pending + data).split(b"\n\n")
            pending = events.pop()
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                parsed = _events.decode(event[6:])
                if parsed.get("usage"):
                    s.tokens = parsed["usage"].get("completion_tokens", 0)
                choices = parsed.get("choices")
                if not choices or not (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    continue
                s.first = s.first or now
                s.last = now
                s.chunks += 1
                s.times.append(now)
            if dechunk is not None and dechunk.done:
                break
    finally:
        writer.close()
    s.tokens = s.tokens or s.chunks
    return s
