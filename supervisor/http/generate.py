"""`/v1/chat/completions` and `/v1/completions`: a request becomes a worker stream.

The path of one request:

  body -> typed request (openai_types) -> shared.protocol.Generate
  -> Supervisor.generate: on-demand load (SPEC A, one shared load per model, A5),
     then the admission gate while pressure pauses admission (P3)
  -> tokens from the worker's RequestStream -> JSON or SSE chunks.

Errors before the first token (load refused 507, queue full 503, prefill
rejected 400 per G1) get a real HTTP status even for streamed requests: the
SSE response only starts once the first token is there, which costs the
client nothing (it could not have read a chunk earlier anyway). After that,
a failure is one `data: {"error": ...}` event, which the OpenAI SDK raises.

A client that goes away is noticed while it waits (load, queue, generation)
and its request is aborted in the worker (`Supervisor.cancel`), so nobody's
memory keeps working for a reader who left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import MutableMapping
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shared import protocol as p
from supervisor.api import Supervisor
from supervisor.errors import ServeError
from supervisor.http.body import Disconnected
from supervisor.http.errors import from_failed, from_serve_error
from supervisor.http.metrics import Metrics
from supervisor.http.openai_types import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_STOP_SEQUENCES,
    BodyError,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatMessageOut,
    ChatRequest,
    ChunkChoice,
    CompletionRequest,
    Delta,
    PromptTokensDetails,
    TextChoice,
    TextCompletion,
    Usage,
    decode_body,
)
from supervisor.streams import RequestStream, StreamReply

log = logging.getLogger("memvisor.http")

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------
# request -> Generate


def _refuse_unsupported(req, *names: str) -> None:
    """Known OpenAI parameters we cannot honour are refused, not ignored."""
    if req.n not in (None, 1):
        raise BodyError("n: only n=1 is supported", param="n")
    if req.logprobs not in (None, False, 0):
        raise BodyError("logprobs: log probabilities are not supported", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise BodyError(f"{name}: not supported (only 0)", param=name)
    for name in names:
        if getattr(req, name):
            raise BodyError(f"{name}: not supported by this server", param=name)


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise BodyError(f"stop: at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    if any(not s for s in stops):
        raise BodyError("stop: sequences must not be empty", param="stop")
    return stops


def _seed(seed: int | None) -> int | None:
    """OpenAI's seeds are int64; the wire (msgpack) carries int64 and uint64.
    Past both the supervisor could not encode the worker's command (a 500)."""
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise BodyError("seed: must fit in 64 bits", param="seed")
    return seed


def _sampling(req, max_tokens: int) -> dict:
    return dict(request_id=uuid.uuid4().hex, max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, stop=_stops(req.stop), seed=_seed(req.seed))


def chat_generate(req: ChatRequest) -> p.Generate:
    """OpenAI chat -> Generate with messages (the worker applies the model's chat template)."""
    _refuse_unsupported(req, "tools", "top_logprobs")
    if not req.messages:
        raise BodyError("messages: must contain at least one message", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise BodyError(f"messages[{i}].content[{j}]: only text parts are supported "
                                    f"(got type {part.type!r})", param=f"messages[{i}].content[{j}].type")
                parts.append(part.text)
            text = "".join(parts)
        else:
            text = m.content or ""
        messages.append(p.ChatMessage(role="system" if m.role == "developer" else m.role, content=text))
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    return p.Generate(messages=messages, **_sampling(req, max_tokens))


def completion_generate(req: CompletionRequest) -> p.Generate:
    """Legacy completions: the prompt goes to the model as is, no template."""
    _refuse_unsupported(req, "echo", "suffix")
    if req.best_of not in (None, 1):
        raise BodyError("best_of: only 1 is supported", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BodyError("prompt: exactly one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise BodyError("prompt: must not be empty", param="prompt")
    return p.Generate(prompt=prompt, **_sampling(req, req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS))


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
    wait for a load leaves the load running (the arbiter shields it, A5)."""
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


async def open_stream(sup: Supervisor, model: str, gen: p.Generate, receive: Receive) -> RequestStream:
    try:
        return await race_client(sup.generate(model, gen), receive)
    except ServeError as exc:
        raise from_serve_error(exc) from None


# ---------------------------------------------------------------------------
# one request, start to finish


_CLIENT_GONE = object()  # put in a stream's queue when its client disconnects


class Job:
    """One generation as the front door sees it: ids, timing, the shape of its output."""

    def __init__(self, sup: Supervisor, metrics: Metrics, kind: str, model: str, gen: p.Generate,
                 include_usage: bool, started: float, stream: RequestStream) -> None:
        self.sup = sup
        self.metrics = metrics
        self.kind = kind  # "chat" | "text"
        self.model = model
        self.gen = gen
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + gen.request_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self.started = started
        self.stream = stream
        self.finished = False
        self.tokens = 0
        self._token_frame: tuple[bytes, bytes] | None = None  # issue 11: see token_chunk

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
        else:
            self.finished = True
            if isinstance(msg, p.Finished):
                self.metrics.finished(self.model, msg.completion_tokens)
            else:
                self.metrics.failed(self.model, msg.code)
        return msg

    # -- non-streamed ---------------------------------------------------------

    async def whole(self, receive: Receive) -> Response:
        parts: list[str] = []
        watcher = self.watch(receive)
        try:
            msg = await self.next_message()
            while isinstance(msg, p.TokenOut):
                parts.append(msg.text)
                msg = await self.next_message()
        finally:
            watcher.cancel()
            self.cancel("the request ended before its generation")  # no-op once finished
        if isinstance(msg, p.Failed):
            raise from_failed(msg)
        usage = _usage(msg)
        text = "".join(parts)
        body: ChatCompletion | TextCompletion
        if self.kind == "chat":
            body = ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
                ChatChoice(index=0, message=ChatMessageOut(role="assistant", content=text),
                           finish_reason=msg.finish_reason)])
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
                TextChoice(index=0, text=text, finish_reason=msg.finish_reason)])
        return Response(_encoder.encode(body), media_type="application/json")

    # -- streamed -------------------------------------------------------------

    async def streamed(self, receive: Receive) -> Response:
        """Wait for the first message, so early errors keep their HTTP status.

        Our watcher stops before the response starts: from then on Starlette
        listens for the disconnect and cancels `events`."""
        watcher = self.watch(receive)
        try:
            first = await self.next_message()
        except BaseException:
            self.cancel("the request ended before its first token")
            raise
        finally:
            watcher.cancel()
        if isinstance(first, p.Failed):
            raise from_failed(first)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(self.events(first), media_type="text/event-stream", headers=headers)

    async def events(self, first: StreamReply) -> AsyncIterator[bytes]:
        """SSE body; tokens that arrived together leave in one write."""
        try:
            out = [self.chunk(None, role=True)] if self.kind == "chat" else []
            msg = first
            while True:
                out.append(self.render(msg))
                if not isinstance(msg, p.TokenOut):
                    break
                if self.stream.queue.empty():
                    yield b"".join(out)
                    out = []
                msg = await self.next_message()
            out.append(SSE_DONE)
            yield b"".join(out)
        finally:  # cancelled by Starlette when the client went away
            self.cancel("client disconnected")

    def render(self, msg: StreamReply) -> bytes:
        if isinstance(msg, p.TokenOut):
            return self.token_chunk(msg.text) if msg.text else b""  # a token that ends mid-character
        if isinstance(msg, p.Failed):
            log.info("request %s failed mid-stream: %s: %s", self.id, msg.code, msg.message)
            return b"data: " + from_failed(msg).body() + b"\n\n"
        last = self.chunk(None, finish=msg.finish_reason)
        if self.include_usage:
            last += self.usage_chunk(_usage(msg))
        return last

    def chunk(self, text: str | None, *, role: bool = False, finish: str | None = None) -> bytes:
        usage = None if self.include_usage else msgspec.UNSET
        body: ChatChunk | TextCompletion
        if self.kind == "chat":
            delta = Delta(role="assistant", content="") if role else Delta(content=text)
            body = ChatChunk(id=self.id, created=self.created, model=self.model, usage=usage,
                             choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)])
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, usage=usage,
                                  choices=[TextChoice(index=0, text=text or "", finish_reason=finish)])
        return b"data: " + _encoder.encode(body) + b"\n\n"

    # -- issue 11: the per-token hot path ---------------------------------------------
    _MARK = "\x00memvisor-token\x00"  # JSON-encodes to an escape no real text can collide with

    def token_chunk(self, text: str) -> bytes:
        """`chunk(text)`, byte for byte, without building the chunk's Structs per token.

        Why: every streamed token makes one chunk, and 8 streams at GPU speed
        make thousands a second. The chunk around the text never changes within
        a request, so it is encoded once (with a marker for the text) and split;
        each token then costs one string encode and a join.
        """
        frame = self._token_frame
        if frame is None:
            whole = self.chunk(self._MARK)
            before, _, after = whole.partition(_encoder.encode(self._MARK))
            frame = self._token_frame = (before, after)
        return frame[0] + _encoder.encode(text) + frame[1]
    # -- end issue 11 ------------------------------------------------------------------

    def usage_chunk(self, usage: Usage) -> bytes:
        body: ChatChunk | TextCompletion
        if self.kind == "chat":
            body = ChatChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return b"data: " + _encoder.encode(body) + b"\n\n"


def _usage(msg: p.Finished) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
                 total_tokens=msg.prompt_tokens + msg.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=msg.cached_tokens))


async def handle(request: Request, sup: Supervisor, metrics: Metrics, kind: str, body: bytes,
                 started: float) -> Response:
    """Decode, validate, route to the model's worker, answer (JSON or SSE)."""
    req: ChatRequest | CompletionRequest
    if kind == "chat":
        req = decode_body(body, ChatRequest)
        gen = chat_generate(req)
    else:
        req = decode_body(body, CompletionRequest)
        gen = completion_generate(req)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    stream = await open_stream(sup, req.model, gen, request.receive)
    job = Job(sup, metrics, kind, req.model, gen, include_usage, started, stream)
    if req.stream:
        return await job.streamed(request.receive)
    return await job.whole(request.receive)
