"""GET /v1/events: the PUB topics as Server-Sent Events, for browsers and scripts.

Dashboards and scripts that are not ZeroMQ clients follow the guard here
(llama-swap's /api/events is the model). The stream carries exactly what the
PUB socket carries, one SSE event per message:

    id: 4711                       (absent on the stream's own events)
    event: pressure                (the topic: ceiling pressure sample event status)
    data: {"type":"pressure", ...} (the message as JSON; `status` carries S1 inline)

It opens with `event: hello` (wall time and the supervisor's monotonic clock,
so a client can place a sample's `t`; the topics; how far it may lag), then
the replay, then live messages. It ends with `event: dropped` when the client
fell `queue_max` messages behind, or `event: closed` at shutdown.

Query: `?topic=event&topic=pressure` (or `topic=event,pressure`; default all);
`?since=UNIX_SECONDS` replays every kept message after that time; without it
the guard's event history and the latest ceiling, pressure and status come
first. An EventSource that reconnects sends Last-Event-ID and resumes after
it (`?last_event_id=N` does the same for clients that cannot set headers).

Why a raw ASGI endpoint rather than a StreamingResponse: each wake-up takes
every frame waiting and writes it in one chunk, and a write that the client
does not take within WRITE_TIMEOUT ends the stream; the guard never waits on
any of it (supervisor.wiring.fanout).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Callable

import msgspec
from starlette.requests import Request

from shared import protocol as p
from supervisor.doors.api import Supervisor
from supervisor.http.errors import ApiError
from supervisor.wiring.fanout import Frame, Subscription

log = logging.getLogger("memvisor.http")

KEEPALIVE = 15.0        # seconds between SSE comments on a quiet stream (proxies close idle ones)
WRITE_TIMEOUT = 30.0    # a client that takes no bytes for this long is let go
RETRY_MS = 2000         # EventSource's reconnection delay

_json = msgspec.json.Encoder()


class EventsHello(msgspec.Struct, kw_only=True):
    """The first event of every stream."""

    t: float              # wall clock (unix seconds) now
    monotonic: float      # the supervisor's CLOCK_MONOTONIC now: Sample.t is on this clock
    topics: list[str]
    replayed: int         # messages that follow from the history before live ones
    queue_max: int        # messages this client may lag behind before it is dropped


class StreamQuery(msgspec.Struct, frozen=True, kw_only=True):
    topics: frozenset[str]
    since: float | None = None
    after_id: int | None = None


def parse_query(request: Request) -> StreamQuery:
    """Topics, since and Last-Event-ID; a bad value is a 400 that says which."""
    topics: set[str] = set()
    for value in request.query_params.getlist("topic"):
        for name in value.split(","):
            name = name.strip()
            if name and name not in p.TOPICS:
                raise ApiError(400, f"unknown topic {name!r}: choose from {', '.join(p.TOPICS)}",
                               code="invalid_topic", param="topic")
            if name:
                topics.add(name)
    since = _number(request.query_params.get("since"), float, "since", "unix seconds, e.g. 1764579600.5")
    last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    after_id = _number(last, int, "last_event_id", "an event id this server sent")
    return StreamQuery(topics=frozenset(topics or p.TOPICS), since=since, after_id=after_id)


def _number(text: str | None, kind: type, param: str, expected: str):
    if text is None or text.strip() == "":
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ApiError(400, f"{param}={text!r} is not a number; expected {expected}", code="invalid_request",
                       param=param) from None
    if value != value or value < 0:  # NaN or negative
        raise ApiError(400, f"{param} must be 0 or more", code="invalid_request", param=param)
    return value


def sse_bytes(frame: Frame) -> bytes:
    """One SSE event. msgspec's JSON has no raw newline, so one data line is enough."""
    head = f"id: {frame.id}\nevent: {frame.topic}\n" if frame.id else f"event: {frame.topic}\n"
    return head.encode() + b"data: " + frame.data + b"\n\n"


def sse_event(name: str, body: msgspec.Struct) -> bytes:
    return f"event: {name}\n".encode() + b"data: " + _json.encode(body) + b"\n\n"


HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),  # nginx in front: do not buffer the stream
]


class EventsEndpoint:
    """The ASGI app behind GET /v1/events.

    `check_access(request)` raises an ApiError for a client that may not read
    (the read-side rule of the API: today open like /status; where API keys
    come, they go there). EventSource cannot send headers, so a rule that
    needs a key must also accept it from the query string.
    """

    def __init__(self, sup: Supervisor, check_access: Callable[[Request], None]) -> None:
        self.sup = sup
        self.check_access = check_access

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        try:
            self.check_access(request)
            query = parse_query(request)
        except ApiError as exc:
            await exc.response()(scope, receive, send)
            return
        sub = self.sup.subscribe(query.topics, since=query.since, after_id=query.after_id)
        hello = EventsHello(t=time.time(), monotonic=time.monotonic(), topics=sorted(query.topics),
                      replayed=len(sub.backlog), queue_max=sub.queue_max)
        watcher = asyncio.get_running_loop().create_task(_until_disconnect(receive, sub))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"retry: {RETRY_MS}\n\n".encode() + sse_event("hello", hello)})
            if await self._pump(sub, send):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            sub.close()
            watcher.cancel()

    async def _pump(self, sub: Subscription, send) -> bool:
        """Write until the stream ends; False when the client stopped taking bytes."""
        while True:
            frames = await sub.get(KEEPALIVE)
            if frames is None:
                return True
            chunk = b"".join(sse_bytes(f) for f in frames) if frames else b": keepalive\n\n"
            try:
                await _within(WRITE_TIMEOUT, send({"type": "http.response.body", "body": chunk, "more_body": True}))
            except asyncio.TimeoutError:
                log.info("an event-stream client took nothing for %.0f s; closing its stream", WRITE_TIMEOUT)
                return False


async def _within(seconds: float, awaitable) -> None:
    """asyncio.timeout where there is one (3.11+: no task per write, as wait_for makes)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            await awaitable
    else:
        await asyncio.wait_for(awaitable, seconds)


async def _until_disconnect(receive, sub: Subscription) -> None:
    """The client left: end its subscription at once, not at the next write."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            sub.close()
            return
