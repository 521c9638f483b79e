"""Reading request bodies without trusting their size.

The limit (`[supervisor] max_body`) is enforced while reading: a declared
Content-Length over it is refused before a byte is read, and a chunked body
is refused as soon as it crosses the limit. The supervisor guards the
machine's memory, so its own front door must not be the thing that buffers a
1 GB upload.

After a refusal we keep reading (and discarding) a bounded amount, so a
client that sends a modestly oversized body reads a clean 413 instead of a
connection reset; beyond that bound the connection is simply closed.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from shared.sizes import MiB, format_size
from supervisor.http.errors import ApiError

# Discard at most this much of a refused body before answering.
DRAIN_LIMIT = 16 * MiB
# Seconds a client has to send its whole body (the default of [supervisor] body_timeout).
BODY_DEADLINE = 30.0


class Disconnected(Exception):
    """The client went away while we read its body: there is no one to answer."""


def too_large(limit: int, seen: str) -> ApiError:
    return ApiError(413, f"the request body ({seen}) exceeds the limit of {format_size(limit)} "
                         "([supervisor] max_body)", code="request_too_large")


async def read_body(request: Request, limit: int, deadline: float = BODY_DEADLINE) -> bytes:
    """The whole body, or ApiError: 413 over `limit`, 408 when it has not all
    arrived within `deadline` seconds (a body shorter than its Content-Length
    would hold its connection until the client gave up)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise ApiError(400, f"Content-Length {declared!r} is not a number", code="invalid_request") from None
        if length > limit and length > DRAIN_LIMIT:
            raise too_large(limit, format_size(length))
    try:
        size, chunks = await asyncio.wait_for(_read(request, limit), deadline)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {deadline:g} s "
                            "([supervisor] body_timeout)", code="request_timeout",
                       headers={"Connection": "close"}) from None
    if size > limit:
        raise too_large(limit, format_size(size) if declared is not None else f"at least {format_size(size)}")
    return b"".join(chunks)


async def _read(request: Request, limit: int) -> tuple[int, list[bytes]]:
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DRAIN_LIMIT:
                break  # refused; stop reading and let the connection close
    except ClientDisconnect:
        raise Disconnected() from None
    return size, chunks
