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

Issue 13: `Job.pieces` turns the worker's stream into API-neutral pieces
(text, tool calls, the end, an error) that this module renders as OpenAI
chat/completions and `anthropic.py` / `responses.py` render as theirs;
`tools.py` holds the tool plan (template tools, ToolCallConstraint,
reading calls back). `response_format` maps to the worker's JSON
constraints, and `keep_alive` / `ttl` set the model's idle timer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from collections.abc import MutableMapping
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, TypeVar, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shared import protocol as p
from shared.fim import FIM_UNSUPPORTED
from shared.vocab import ReplyFinishReason
from supervisor.api import Supervisor
from supervisor.errors import ServeError
from supervisor.http import routing, sampling, tools
from supervisor.http.body import Disconnected
from supervisor.http.content import text_of
from supervisor.http.errors import ApiError, from_failed, from_serve_error
from supervisor.http.metrics import Metrics
from supervisor.http.modelfacts import require_fim
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
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    FunctionCall,
    PromptTokensDetails,
    ResponseFormat,
    TextChoice,
    TextCompletion,
    ToolCall,
    Usage,
    decode_body,
)
from supervisor.http.tools import ToolPlan
from supervisor.streams import RequestStream, StreamReply

log = logging.getLogger("memvisor.http")

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
# An API's SSE rendering of a stream, from its first message: a list of events per piece.
Events = Callable[[StreamReply], AsyncIterator[list[bytes]]]

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------
# request -> Generate


def _refuse_unsupported(req, *names: str) -> None:
    """Known OpenAI parameters we cannot honour are refused, not ignored."""
    if req.n not in (None, 1):
        raise BodyError("n: only n=1 is supported", param="n")
    for name in names:
        if getattr(req, name):
            raise BodyError(f"{name}: not supported by this server", param=name)


def _refuse_chat_extras(req: ChatRequest) -> None:
    """Chat fields that would change the output in ways we cannot: a 400 naming each."""
    if req.store:
        raise BodyError("store: this server stores no completions (only false)", param="store")
    if req.modalities not in (None, ["text"]):
        raise BodyError("modalities: only [\"text\"] is supported", param="modalities")
    for name, why in (("audio", "audio output"), ("functions", "the deprecated functions (use tools)"),
                      ("function_call", "the deprecated function_call (use tool_choice)"),
                      ("reasoning_effort", "reasoning effort (these models do not reason)"),
                      ("verbosity", "verbosity"), ("web_search_options", "web search"),
                      ("moderation", "moderation")):
        if getattr(req, name) is not None:
            raise BodyError(f"{name}: {why} is not supported by this server", param=name)


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
                top_p=1.0 if req.top_p is None else req.top_p, stop=_stops(req.stop), seed=_seed(req.seed),
                **sampling.generate_fields(req))  # top_k, min_p, penalties, logit_bias


def response_format_constraint(fmt: ResponseFormat | None) -> p.ConstraintSpec | None:
    """Structured output: enforced by the worker's constrained decoding, never hoped for."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return p.JsonObject()
    js = fmt.json_schema
    if js is None or js.schema is None:
        raise BodyError("response_format.json_schema.schema: a json_schema format needs its schema",
                        param="response_format.json_schema")
    return p.JsonSchema(schema=_encoder.encode(js.schema).decode(), strict=bool(js.strict), name=js.name)


def chat_tool_plan(req: ChatRequest) -> ToolPlan | None:
    """tools + tool_choice + parallel_tool_calls (OpenAI chat spelling) -> the plan."""
    if not req.tools and req.tool_choice in (None, "none", "auto"):
        return None
    fns = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or t.function is None:
            raise BodyError(f"tools[{i}].type: only function tools are supported (got {t.type!r})",
                            param=f"tools[{i}].type")
        f = t.function
        fns.append(tools.function(f.name, f.description, f.parameters, f.strict, f"tools[{i}].function"))
    choice, named = tools.openai_choice(req.tool_choice, nested=True)
    plan = ToolPlan(functions=fns, choice=choice, named=named, parallel=req.parallel_tool_calls is not False)
    return tools.check_named(plan, "tool_choice")


def _chat_message(i: int, m) -> p.ChatMessage:
    for name in ("function_call", "audio"):
        if getattr(m, name) is not None:
            raise BodyError(f"messages[{i}].{name}: not supported", param=f"messages[{i}].{name}")
    text = text_of(m.content, f"messages[{i}].content", ("text", "input_text"))
    calls = None
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                args = msgspec.json.decode(c.function.arguments)
            except msgspec.DecodeError:
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise BodyError(f"{where}: not valid JSON", param=where) from None
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    if m.role == "tool" and not m.tool_call_id:
        raise BodyError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                        param=f"messages[{i}].tool_call_id")
    return p.ChatMessage(role="system" if m.role == "developer" else m.role, content=text,
                         tool_calls=_encoder.encode(calls).decode() if calls else None,
                         tool_call_id=m.tool_call_id)


def chat_generate(req: ChatRequest) -> p.Generate:
    """OpenAI chat -> Generate with messages (the worker applies the model's chat template)."""
    _refuse_unsupported(req)
    _refuse_chat_extras(req)
    if not req.messages:
        raise BodyError("messages: must contain at least one message", param="messages")
    messages = [_chat_message(i, m) for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    plan = chat_tool_plan(req)
    fmt = response_format_constraint(req.response_format)
    logprobs = sampling.chat_logprobs(req.logprobs, req.top_logprobs)
    return with_tools(p.Generate(messages=messages, constraint=fmt, **_sampling(req, max_tokens), **logprobs), plan)


def with_tools(gen: p.Generate, plan: ToolPlan | None) -> p.Generate:
    """The plan's tools for the template and, for required/named, its constraint."""
    if plan is None:
        return gen
    call = plan.constraint()
    if call is not None and gen.constraint is not None:
        raise BodyError("tool_choice: a required tool call and a JSON output format cannot both be "
                        "enforced on one reply; drop one", param="tool_choice")
    gen.tools = plan.template_tools() if plan.functions else None
    gen.constraint = call or gen.constraint
    return gen


def completion_generate(req: CompletionRequest) -> p.Generate:
    """Legacy completions: the prompt goes to the model as is, no template."""
    _refuse_unsupported(req, "echo")
    if req.best_of not in (None, 1):
        raise BodyError("best_of: only 1 is supported", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BodyError("prompt: exactly one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt and req.suffix is None:  # fill in the middle may start at the top of a file
        raise BodyError("prompt: must not be empty", param="prompt")
    return p.Generate(prompt=prompt, suffix=req.suffix, **_sampling(req, req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS),
                      **sampling.completion_logprobs(req.logprobs))


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


async def open_job(request: Request, sup: Supervisor, metrics: Metrics, req, gen: p.Generate, started: float, *,
                   kind: str = "chat", plan: ToolPlan | None = None, include_usage: bool = False,
                   format_param: str = "response_format") -> Job:
    """`gen` routed to `req.model` under the request's keep_alive / ttl (`open_stream`:
    a load, the queue), and the Job that reads its stream."""
    keep = keep_alive_seconds(req.keep_alive, req.ttl)
    stream = await open_stream(sup, req.model, gen, request.receive, keep)
    return Job(sup, metrics, kind, req.model, gen, include_usage, started, stream, plan, format_param)


async def open_stream(sup: Supervisor, model: str, gen: p.Generate, receive: Receive,
                      keep_alive: float | None = None) -> RequestStream:
    served = routing.current()  # issue 24: X-Memvisor-Max-Wait in, X-Memvisor-Worker out
    try:
        stream = await race_client(sup.generate(model, gen, max_wait=served.max_wait()), receive)
        if stream.worker is not None:
            served.worker = stream.worker.worker_id
        if keep_alive is not None:  # the model is loaded now: its idle timer is this request's
            sup.keep_alive(model, keep_alive)
        return stream
    except ServeError as exc:
        raise from_serve_error(exc) from None


# ---------------------------------------------------------------------------
# one request, start to finish


_CLIENT_GONE = object()  # put in a stream's queue when its client disconnects


class Job:
    """One generation as the front door sees it: ids, timing, the shape of its output."""

    def __init__(self, sup: Supervisor, metrics: Metrics, kind: str, model: str, gen: p.Generate,
                 include_usage: bool, started: float, stream: RequestStream,
                 plan: ToolPlan | None = None, format_param: str = "response_format") -> None:
        self.sup = sup
        self.format_param = format_param  # issue 21: where this API carries an output format
        self.plan = plan  # issue 13: how to read tool calls out of the reply
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
        self.logprobs: list[p.TokenLogprobs] = []  # each token's, when the request asked
        self._reported = 0  # how many of them streamed chunks have carried
        self._offset = 0  # completions' text_offset of the next token reported

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
                self.metrics.finished(self.model, msg.completion_tokens)
            else:
                self.metrics.failed(self.model, msg.code)
        return msg

    def take_logprobs(self) -> list[p.TokenLogprobs]:
        """Issue 23: the logprobs of the tokens read so far that no streamed piece has carried.

        Why a running list and not a field of `Text`: a token whose text the
        detokenizer or a stop string holds back still has its logprob, and the
        pieces stay the same for every API; each renders what it takes here."""
        items = self.logprobs[self._reported:]
        self._reported = len(self.logprobs)
        return items

    def completion_logprobs(self, items: list[p.TokenLogprobs]) -> CompletionLogprobs:
        """Completions' columns for `items`, their text offsets following the tokens before them."""
        out = sampling.completion_choice_logprobs(items, self._offset)
        self._offset += sum(len(item.token) for item in items)
        return out

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
            # Issue 23: the reply is the call list and nothing else. Cut by max_tokens before
            # its first call closed it holds no call: an empty answer with the worker's
            # finish_reason ("length"), never the partial JSON as text.
            calls, text = tools.parse_constrained(text), ""
        elif mode == "auto" and text:
            text, calls = tools.parse_tagged(text)
        if text:
            yield Text(text)
        if calls:
            yield Calls(calls)
            reason = "tool_calls" if reason == "stop" else reason
        yield End(msg, reason)

    @property
    def calls_only(self) -> bool:
        """Issue 23: a call was required (tool_choice required or named): the reply is its
        call list, empty when max_tokens cut the first call, and never text."""
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

    # -- non-streamed ---------------------------------------------------------

    async def whole(self, receive: Receive) -> Response:
        text, calls, end = await self.collect(receive)
        usage = _usage(end.finished)
        body: ChatCompletion | TextCompletion
        if self.kind == "chat":
            message = ChatMessageOut(role="assistant", content=text or (None if calls or self.calls_only else ""))
            if calls or self.calls_only:
                message.tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                                      for c in calls]
            logprobs = sampling.chat_choice_logprobs(self.logprobs) if self.gen.logprobs else None
            body = ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
                ChatChoice(index=0, message=message, finish_reason=end.reason, logprobs=logprobs)])
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
                TextChoice(index=0, text=text, finish_reason=end.reason,
                           logprobs=self.completion_logprobs(self.logprobs) if self.gen.logprobs else None)])
        return Response(_encoder.encode(body), media_type="application/json")

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
        """Issue 23: the worker's `Prompted` (the prompt's length once its prefill starts), or
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

    async def streamed(self, receive: Receive, events: Events | None = None) -> Response:
        """The SSE response, once the first message is in: `events` renders the
        pieces (OpenAI's chunks unless given: see anthropic.py, responses.py)."""
        first = await self.first(receive)
        return sse_response(self.sse_body((events or self.chunks)(first)))

    async def chunks(self, first: StreamReply) -> AsyncIterator[list[bytes]]:
        """A streamed chat or text completion's SSE events, a list per piece."""
        out = [self.chunk(None, role=True)] if self.kind == "chat" else []
        async for piece in self.pieces(first):
            out.append(self.render(piece))
            yield out
            out = []
        yield [SSE_DONE]

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

    def render(self, piece: Piece) -> bytes:
        match piece:
            case Text(text=text):
                if self.gen.logprobs:  # the tokens' logprobs ride with their text
                    return self.chunk(text, logprobs=self.take_logprobs())
                return self.token_chunk(text) if text else b""  # the hot path (issue 11)
            case Calls(calls=calls):
                deltas = [ToolCall(index=i, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                          for i, c in enumerate(calls)]
                return self.chunk(None, calls=deltas)
            case ApiError():
                log.info("request %s failed mid-stream: %s: %s", self.id, piece.code, piece.message)
                return b"data: " + piece.body() + b"\n\n"
            case End(finished=fin, reason=reason):
                last = self.chunk(None, finish=reason)
                held = self.take_logprobs() if self.gen.logprobs else []
                if held:  # tokens whose text never came out (held back, or tool calls): theirs before the end
                    last = self.chunk("", logprobs=held) + last
                if self.include_usage:
                    last += self.usage_chunk(_usage(fin))
                return last
        return b""

    def chunk(self, text: str | None, *, role: bool = False, finish: ReplyFinishReason | None = None,
              calls: list[ToolCall] | None = None, logprobs: list[p.TokenLogprobs] | None = None) -> bytes:
        usage = None if self.include_usage else msgspec.UNSET
        body: ChatChunk | TextCompletion
        if self.kind == "chat":
            delta = Delta(role="assistant", content="") if role else Delta(content=text, tool_calls=calls)
            choice = ChunkChoice(index=0, delta=delta, finish_reason=finish,
                                 logprobs=None if logprobs is None else sampling.chat_choice_logprobs(logprobs))
            body = ChatChunk(id=self.id, created=self.created, model=self.model, usage=usage, choices=[choice])
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
                TextChoice(index=0, text=text or "", finish_reason=finish,
                           logprobs=None if logprobs is None else self.completion_logprobs(logprobs))])
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


def _usage(msg: p.Finished) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
                 total_tokens=msg.prompt_tokens + msg.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=msg.cached_tokens,
                                                           disk_cached_tokens=msg.cached_disk_tokens))


def keep_alive_seconds(keep_alive, ttl: int | None) -> float | None:
    """Ollama's keep_alive / LM Studio's ttl -> the model's idle timer in seconds.

    0 unloads right after the request; a negative value keeps it loaded (P10's
    0 = never), as Ollama does; None leaves the configured timer alone. Parsed
    strictly and before any generation starts (issue 21): "inf" was a 500 that
    left a generation running for nobody and "nan" meant "unload now", so only
    finite values up to MAX_KEEP_ALIVE pass."""
    if keep_alive is None and ttl is None:
        return None
    if keep_alive is None:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 <= ttl <= MAX_KEEP_ALIVE:
            raise BodyError(f"ttl: whole seconds from 0 to {MAX_KEEP_ALIVE:.0f}, got {ttl!r}", param="ttl")
        seconds: float = ttl
    elif isinstance(keep_alive, (int, float)) and not isinstance(keep_alive, bool):
        seconds = _bounded(float(keep_alive), keep_alive)
    elif isinstance(keep_alive, str):
        seconds = _bounded(_duration(keep_alive), keep_alive)
    else:
        raise BodyError(f"keep_alive: seconds or a duration like \"5m\", got {keep_alive!r}", param="keep_alive")
    if seconds < 0:
        return 0.0  # never expires
    return seconds if seconds > 0 else UNLOAD_NOW


UNLOAD_NOW = 1e-3  # P10 expires an idle model whose idle time exceeds its TTL: at once
MAX_KEEP_ALIVE = 10 * 365 * 86400.0  # ten years: longer is "forever", which is spelled -1
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_DURATION = re.compile(r"([+-]?)((?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+)")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _bounded(seconds: float, given: object) -> float:
    """A finite number of seconds no longer than MAX_KEEP_ALIVE either way; BodyError otherwise."""
    if not math.isfinite(seconds) or abs(seconds) > MAX_KEEP_ALIVE:
        raise BodyError(f"keep_alive: {given!r} is not a usable duration: give finite seconds up to "
                        f"{MAX_KEEP_ALIVE:.0f} (ten years), or -1 to keep the model loaded",
                        param="keep_alive")
    return seconds


def _duration(text: str) -> float:
    """"5m", "1h30m", "90s", "-1", "0" (Go durations, as Ollama takes them): decimal
    numbers only, so "inf", "nan", "1e999" and "0x10" are refused, not read by float()."""
    text = text.strip()
    if _NUMBER.fullmatch(text):
        return float(text)
    match = _DURATION.fullmatch(text)
    if match is None:
        raise BodyError(f"keep_alive: {text!r} is not a duration like \"5m\", \"1h\", \"0\" or \"-1\"",
                        param="keep_alive")
    total = sum(float(a) * _UNITS[u] for a, u in _PART.findall(match[2]))
    return -total if match[1] == "-" else total


def _model(sup: Supervisor, name: str):
    try:
        return sup.model_config(name)
    except ServeError as exc:
        raise from_serve_error(exc) from None


async def handle(request: Request, sup: Supervisor, metrics: Metrics, kind: str, body: bytes,
                 started: float) -> Response:
    """Decode, validate, route to the model's worker, answer (JSON or SSE)."""
    req: ChatRequest | CompletionRequest
    plan = None
    if kind == "chat":
        req = decode_body(body, ChatRequest)
        gen = chat_generate(req)
        plan = chat_tool_plan(req)
    else:
        req = decode_body(body, CompletionRequest)
        gen = completion_generate(req)
        if req.suffix is not None:  # issue 23: refused before any load where the card says no insert
            model = _model(sup, req.model)
            await require_fim(model.id, model.path)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    job = await open_job(request, sup, metrics, req, gen, started, kind=kind, plan=plan, include_usage=include_usage)
    if req.stream:
        return await job.streamed(request.receive)
    return await job.whole(request.receive)
