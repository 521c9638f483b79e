"""One generation as the front door sees it, whatever the API.

The path of one request:

  body -> the API's typed request -> shared.protocol.Generate (and its tool plan)
  -> Supervisor.generate: on-demand load (SPEC A, one shared load per model, A5),
     then the admission gate while pressure pauses admission (P3)
  -> tokens from the worker's RequestStream -> the API's JSON or SSE.

Errors before the first token (load refused 507, queue full 503, prefill
rejected 400 per G1) get a real HTTP status even for streamed requests when
they come within a second: a streamed response starts with the first token,
or after that second with lines that say what it waits for (http/streaming.py).
After that, a failure is one error event in the API's shape.

A client that goes away is noticed while it waits (load, queue, generation)
and its request is aborted in the worker (`Supervisor.cancel`), so nobody's
memory keeps working for a reader who left.

`Job.pieces` turns the worker's stream into API-neutral pieces (text, tool
calls, the end, an error) that openai.py renders as OpenAI chat and text
completions, anthropic.py, responses.py and ollama.py as theirs; tools.py
holds the tool plan (template tools, ToolCall constraint, reading calls back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import MutableMapping
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, TypeVar, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shared import protocol as p
from shared.fim import FIM_UNSUPPORTED
from shared.vocab import ReplyFinishReason
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http import images, partitions, routing, tools
from supervisor.http.body import Disconnected
from supervisor.http.errors import ApiError, from_failed, from_serve_error
from supervisor.http.keepalive import keep_alive_seconds
from supervisor.http.metrics import Metrics
from supervisor.http.tools import Planned, ToolPlan
from supervisor.workers.streams import RequestStream, StreamReply

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
# An API's SSE rendering of a stream, from its first message: a list of events per piece.
Events = Callable[[StreamReply], AsyncIterator[list[bytes]]]


# ---------------------------------------------------------------------------
# waiting while watching the client


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_client(coro: Awaitable[T], receive: Receive) -> T:
    """Await `coro` unless the client disconnects first (then Disconnected).

    Cancelling a queued request just drops it from the gate; cancelling our
    wait for a load leaves the load running (the models shield it, A5)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise Disconnected()


async def open_job(request: Request, sup: Supervisor, metrics: Metrics, req, work: Planned, started: float, *,
                   format_param: str = "response_format", receive: Receive | None = None) -> Job:
    """`work` routed to `req.model` under the request's keep_alive / ttl (`open_stream`:
    a load, the queue), and the Job that reads its stream. `receive`: where a disconnect is
    watched for (the request's own by default)."""
    keep = keep_alive_seconds(req.keep_alive, req.ttl)
    stream = await open_stream(sup, req.model, work.gen, receive or request.receive, keep)
    return Job(sup, metrics, req.model, work.gen, started, stream, work.plan, format_param)


async def open_stream(sup: Supervisor, model: str, gen: p.Generate, receive: Receive,
                      keep_alive: float | None = None) -> RequestStream:
    served = routing.current()  # a router's X-Memvisor-Max-Wait in, X-Memvisor-Worker out
    gen = await images.prepare(sup, model, gen)  # fetched, decoded and checked (a 400 naming the field)
    gen.partition = partitions.current()  # the caller's key's prompt cache, and only it (H7 as proposed)
    try:
        stream = await race_client(sup.generate(model, gen, max_wait=served.max_wait()), receive)
        served.worker = stream.worker_id
        if keep_alive is not None:  # the model is loaded now: its idle timer is this request's
            sup.keep_alive(model, keep_alive)
        return stream
    except ServeError as exc:
        raise from_serve_error(exc) from None


# ---------------------------------------------------------------------------
# one request, start to finish


_CLIENT_GONE = object()  # put in a stream's queue when its client disconnects


class Job:
    """One generation as the front door sees it: its stream, timing, and how its reply is read."""

    def __init__(self, sup: Supervisor, metrics: Metrics, model: str, gen: p.Generate, started: float,
                 stream: RequestStream, plan: ToolPlan | None = None, format_param: str = "response_format") -> None:
        self.sup = sup
        self.format_param = format_param  # where this API carries an output format
        self.plan = plan  # how to read tool calls out of the reply
        self.metrics = metrics
        self.model = model
        self.gen = gen
        self.started = started
        self.stream = stream
        self.finished = False
        self.tokens = 0
        self.logprobs: list[p.TokenLogprobs] = []  # each token's, when the request asked
        self._reported = 0  # how many of them streamed chunks have carried

    def cancel(self, reason: str) -> None:
        """Abort the worker's request unless it already ended (idempotent)."""
        if not self.finished:
            self.finished = True
            self.sup.cancel(self.stream, reason)
            self.metrics.cancelled(self.model)

    def watch(self, receive: Receive) -> asyncio.Task[None]:
        """Until cancelled: a disconnect wakes the reader of the stream's queue."""
        queue = self.stream.queue

        async def watcher() -> None:
            await wait_for_disconnect(receive)
            queue.put_nowait(_CLIENT_GONE)

        return asyncio.ensure_future(watcher())

    async def next_message(self) -> StreamReply:
        msg = await self.stream.queue.get()
        if not isinstance(msg, (p.TokenOut, p.Finished, p.Failed)):  # _CLIENT_GONE
            self.cancel("client disconnected")
            raise Disconnected()
        if isinstance(msg, p.TokenOut):
            if self.tokens == 0:
                self.metrics.first_token(self.model, time.monotonic() - self.started)
            self.tokens += 1
            if msg.logprobs is not msgspec.UNSET:
                self.logprobs.append(msg.logprobs)
        else:
            self.finished = True
            if isinstance(msg, p.Finished):
                self.metrics.finished(self.model, msg.completion_tokens, msg.proposed_tokens, msg.accepted_tokens)
            else:
                self.metrics.failed(self.model, msg.code)
        return msg

    def take_logprobs(self) -> list[p.TokenLogprobs]:
        """The logprobs of the tokens read so far that no streamed piece has carried.

        Why a running list and not a field of `Text`: a token whose text the
        detokenizer or a stop string holds back still has its logprob, and the
        pieces stay the same for every API; each renders what it takes here."""
        items = self.logprobs[self._reported:]
        self._reported = len(self.logprobs)
        return items

    # -- the reply as pieces, whatever the API -------------------------------

    async def pieces(self, first: StreamReply) -> AsyncIterator[Piece]:
        """Text, tool calls, then the end (or an error): what every API renders.

        Text that may be a tool call is held back: all of it when the call
        was required (the constraint's JSON array), and in `auto` mode until
        the reply's first characters say whether it opens with a call."""
        mode = self.plan.mode if self.plan else "text"
        held: list[str] = []
        msg = first
        while isinstance(msg, p.TokenOut):
            if not msg.text:
                pass
            elif mode == "text":
                yield Text(msg.text)
            else:
                held.append(msg.text)
                if mode == "auto":
                    opens = tools.opens_with_call("".join(held))
                    if opens is False:
                        mode = "text"
                        yield Text("".join(held))
                        held = []
            msg = await self.next_message()
        if isinstance(msg, p.Failed):
            yield self.failure(msg)
            return
        reason: ReplyFinishReason = msg.finish_reason
        text, calls = "".join(held), None
        if mode == "constrained":
            # The reply is the call list and nothing else. Cut by max_tokens before its
            # first call closed it holds no call: an empty answer with the worker's
            # finish_reason ("length"), never the partial JSON as text.
            calls, text = tools.parse_constrained(text), ""
        elif mode == "auto" and text:
            text, calls = tools.parse_tagged(text)
            if reason == "length" and text.strip() and tools.opens_with_call(text) is not False:
                # A call the model had begun (`<tool_call>`, or the start of the tag) when
                # max_tokens cut it: the calls before it stand, the half call is not passed
                # off as the reply's text (the finish_reason says the reply was cut), as for
                # a required call. Whitespace alone stays the text it is.
                text = ""
        if text:
            yield Text(text)
        if calls:
            yield Calls(calls)
            reason = "tool_calls" if reason == "stop" else reason
        yield End(msg, reason)

    @property
    def calls_only(self) -> bool:
        """A call was required (tool_choice required or named): the reply is its call
        list, empty when max_tokens cut the first call, and never text."""
        return self.plan is not None and self.plan.mode == "constrained"

    async def collect(self, receive: Receive) -> tuple[str, list[tools.Call], End]:
        """The whole reply (non-streamed); a failure raises its ApiError."""
        watcher = self.watch(receive)
        text: list[str] = []
        calls: list[tools.Call] = []
        try:
            first = await self.next_message()
            async for piece in self.pieces(first):
                match piece:
                    case Text(text=t):
                        text.append(t)
                    case Calls(calls=c):
                        calls.extend(c)
                    case End():
                        end = piece
                    case ApiError():
                        raise piece
        finally:
            watcher.cancel()
            self.cancel("the request ended before its generation")  # no-op once finished
        return "".join(text), calls, end

    # -- streamed -------------------------------------------------------------

    async def first(self, receive: Receive) -> StreamReply:
        """Wait for the first message, so early errors keep their HTTP status.

        Our watcher stops before the response starts: from then on Starlette
        listens for the disconnect and cancels the events."""
        watcher = self.watch(receive)
        try:
            first = await self.next_message()
        except BaseException:
            self.cancel("the request ended before its first token")
            raise
        finally:
            watcher.cancel()
        if isinstance(first, p.Failed):
            raise self.failure(first)
        return first

    async def prompt(self, receive: Receive) -> p.Prompted | None:
        """The worker's `Prompted` (the prompt's length once its prefill starts), or
        None when the request ended without one (refused or failed first: its error stays in
        the queue for `first`/`collect`). A client that goes away cancels the request."""
        try:
            await race_client(self.stream.prompt_known.wait(), receive)
        except BaseException:
            self.cancel("the request ended before its prompt was counted")
            raise
        return self.stream.prompted

    def failure(self, msg: p.Failed) -> ApiError:
        """The worker's terminal error; a constraint it refused names the field that carried it."""
        error = from_failed(msg)
        if msg.code == "invalid_constraint":
            error.param = "tools" if isinstance(self.gen.constraint, p.ToolCallConstraint) else self.format_param
        elif msg.code == FIM_UNSUPPORTED:
            error.param = "suffix"
        return error

    async def streamed(self, receive: Receive, events: Events) -> Response:
        """The SSE response, once the first message is in: `events` renders the
        pieces (openai.py: OpenAI's chunks; anthropic.py, responses.py: theirs)."""
        first = await self.first(receive)
        return sse_response(self.sse_body(events(first)))

    async def sse_body(self, rendered: AsyncIterator[list[bytes]]) -> AsyncIterator[bytes]:
        """An SSE body from what an API renders of each piece (a list of events per
        piece): the events of pieces that arrived together leave in one write. Ends
        the request with the body, or when the client went away (Starlette then
        cancels the body)."""
        out: list[bytes] = []
        try:
            async for events in rendered:
                out += events
                if self.stream.queue.empty():
                    yield b"".join(out)
                    out = []
            if out:
                yield b"".join(out)
        finally:
            self.cancel("client disconnected")


class Text(NamedTuple):
    text: str


class Calls(NamedTuple):
    calls: list[tools.Call]


class End(NamedTuple):
    finished: p.Finished
    reason: ReplyFinishReason  # the worker's finish_reason, or "tool_calls" when the reply was calls


Piece = Union[Text, Calls, End, ApiError]


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)
