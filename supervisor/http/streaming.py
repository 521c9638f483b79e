"""A streamed reply's headers at once, and a word each second while its request waits.

Before, a streamed request sent its headers only with its first token, so the
load, the queue and the prefill in front of it were silence; a proxy (Open WebUI
behind it) cut one request after 600 s with a 502, unable to tell working from
hung. Now a streamed reply waits at most `EARLY` seconds for its first event:

* what comes by then (the first token, or a refusal: an unknown model 404, a
  model too large 507, a full queue 429, a prompt over the context 400) keeps
  its real HTTP status, as before, which every SDK maps to its typed errors;
* past that the headers go, and while the request still waits, a line every
  `EVERY` seconds says for what: a comment on the SSE routes
  (`: loading 40% (reading weights, 3 s)`, `: queued`,
  `: prefill 1200/6969 tokens`), which every SSE client ignores (the openai
  and anthropic SDKs included), and on Ollama's NDJSON streams an empty chunk
  (`"content": ""`, `done: false`): Ollama's clients parse every line as JSON
  (an empty line or a comment would break them) and append its empty text.
  A refusal that comes after the headers is the API's error event in the stream.

What is waited for is read, never asked: the load's progress from `readiness`
(as `/health?model=` shows it), the prefill's from the worker's
`PrefillProgress` kept on the request's stream.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, MutableMapping, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http.body import Disconnected
from supervisor.http.errors import ApiError
from supervisor.http.job import Job, open_job
from supervisor.http.metrics import Metrics
from supervisor.http.tools import Planned
from supervisor.workers.streams import RequestStream, StreamReply

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

EARLY = 1.0  # seconds a streamed reply's headers wait for its first event
EVERY = 1.0  # seconds between two lines while it waits after that
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def never() -> MutableMapping[str, Any]:
    """A `receive` that never returns: for work that must not read the client's messages
    (once the response has started, Starlette listens for the disconnect and cancels us)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


class Waiting:
    """What a streamed request waits for, in a few words (the streams once it has them)."""

    def __init__(self, sup: Supervisor, model: str) -> None:
        self.sup = sup
        self.model = model
        self.streams: list[RequestStream] = []

    def words(self) -> str:
        if self.streams:
            return self._worker_side()
        try:
            ready = self.sup.readiness(self.model)
        except ServeError:
            return "waiting"
        load = ready.progress
        if load is None:
            return "waiting" if ready.state in ("ready", "busy") else ready.state.replace("_", " ")
        done = load.bytes_read or load.bytes  # the weights read, where the worker counts them
        share = f" {min(99, 100 * done // load.estimate_bytes)}%" if load.estimate_bytes else ""
        return f"loading{share} ({load.phase or load.state}, {load.elapsed:.0f} s)"

    def _worker_side(self) -> str:
        waiting = [s for s in self.streams if s.first_token is None and not s.done]
        progress = [s.progress for s in waiting if s.progress is not None]
        if progress:
            return f"prefill {sum(p.done for p in progress)}/{sum(p.total for p in progress)} tokens"
        if any(s.prompted is not None for s in waiting):
            return "prefill"
        return "queued" if waiting else "generating"


def sse_comment(waiting: Waiting) -> bytes:
    return b": " + waiting.words().encode() + b"\n\n"


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


class Early(Generic[T]):
    """One streamed reply: `start` readies it (the load, the queue, the first event), `render`
    writes it, `idle` is the line while it waits, `failure` a refusal after the headers went,
    `discard` ends what was readied but never rendered (the client left in between)."""

    def __init__(self, start: Awaitable[T], render: Callable[[T], AsyncIterator[bytes]], *,
                 idle: Callable[[], bytes], failure: Callable[[ApiError], bytes],
                 discard: Callable[[T], None], media_type: str = "text/event-stream") -> None:
        self.task = asyncio.ensure_future(start)
        self.render = render
        self.idle = idle
        self.failure = failure
        self.discard = discard
        self.media_type = media_type

    async def response(self, receive: Receive) -> StreamingResponse:
        """The response once the first event is in, or after EARLY seconds: then the headers
        go, and the body waits (and says so) for what `start` readies."""
        watcher = asyncio.ensure_future(_disconnect(receive))
        try:
            done, _ = await asyncio.wait({self.task, watcher}, timeout=EARLY, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self.task.cancel()
            raise
        finally:
            watcher.cancel()
        if not self.task.done():
            if watcher in done:
                self.task.cancel()
                raise Disconnected()
            return StreamingResponse(self._body(), media_type=self.media_type, headers=SSE_HEADERS)
        return StreamingResponse(self.render(self.task.result()), media_type=self.media_type, headers=SSE_HEADERS)

    async def _body(self) -> AsyncIterator[bytes]:
        rendered = False
        try:
            while not self.task.done():
                yield self.idle()
                await asyncio.wait({self.task}, timeout=EVERY)
            try:
                ready = self.task.result()
            except ApiError as exc:
                yield self.failure(exc)
                return
            rendered = True
            async for chunk in self.render(ready):
                yield chunk
        finally:
            if not self.task.done():
                self.task.cancel()
            elif not rendered and not self.task.cancelled() and self.task.exception() is None:
                self.discard(self.task.result())


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def openai_error_event(exc: ApiError) -> bytes:
    """An OpenAI stream's error event: the SDK raises APIError on a `data:` object with `error`."""
    return b"data: " + exc.body() + b"\n\n"


async def stream_job(request: Request, sup: Supervisor, metrics: Metrics, req, work: Planned, started: float,
                     events: Callable[[Job, StreamReply], AsyncIterator[list[bytes]]], *,
                     format_param: str = "response_format",
                     failure: Callable[[ApiError], bytes] = openai_error_event) -> Response:
    """One generation as an SSE reply (`events` renders its pieces, from its first message),
    its headers within EARLY seconds and a comment each second while it waits."""
    waiting = Waiting(sup, req.model)

    async def start() -> tuple[Job, StreamReply]:
        job = await open_job(request, sup, metrics, req, work, started, format_param=format_param, receive=never)
        waiting.streams.append(job.stream)
        return job, await job.first(never)

    early = Early(start(), lambda ready: ready[0].sse_body(events(*ready)), idle=lambda: sse_comment(waiting),
                  failure=failure, discard=lambda ready: ready[0].cancel("client disconnected"))
    return await early.response(request.receive)
