"""`/v1/chat/completions`, and the reply of `/v1/completions`: OpenAI's requests in, its completions out.

An OpenAI chat body becomes the worker's `Generate` (and its tool plan,
http/tools.py); the request then runs as any other (http/job.py: the load, the
queue, the stream, a client that leaves; http/streaming.py: a streamed reply's
early headers), and `Completion` renders its reply as one JSON completion or
SSE chunks, a text completion's choices too (http/completions.py reads the
completions body: several prompts, token ids, echo). `response_format`
maps to the worker's JSON constraints, and `keep_alive` / `ttl` set the
model's idle timer (http/keepalive.py).
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from shared.vocab import ReplyFinishReason
from supervisor.doors.api import Supervisor
from supervisor.http import images, sampling_options, tools
from supervisor.http.errors import ApiError
from supervisor.http.job import Calls, End, Job, Piece, Receive, Text, open_job
from supervisor.http.metrics import Metrics
from supervisor.http.openai_types import (
    DEFAULT_CHAT_MAX_TOKENS,
    MAX_STOP_SEQUENCES,
    BodyError,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatMessageOut,
    ChatRequest,
    ChunkChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
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
from supervisor.http.streaming import stream_job
from supervisor.http.tools import Planned, ToolPlan, planned
from supervisor.workers.streams import StreamReply

log = logging.getLogger("memvisor.http")

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------
# request -> Generate


def refuse_unsupported(req, *names: str) -> None:
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


def stop_sequences(stop, limit: int = MAX_STOP_SEQUENCES) -> list[str]:
    """`stop` as a list, at most `limit` of them (OpenAI's 4 unless the API allows more), none empty."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limit:
        raise BodyError(f"stop: at most {limit} sequences", param="stop")
    if any(not s for s in stops):
        raise BodyError("stop: sequences must not be empty", param="stop")
    return stops


def checked_seed(seed: int | None) -> int | None:
    """OpenAI's seeds are int64; the wire (msgpack) carries int64 and uint64.
    Past both the supervisor could not encode the worker's command (a 500)."""
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise BodyError("seed: must fit in 64 bits", param="seed")
    return seed


def common_fields(req, max_tokens: int, stops: int = MAX_STOP_SEQUENCES) -> dict:
    """The Generate fields chat and completions spell alike (`stops`: how many stop sequences)."""
    return dict(request_id="", max_tokens=max_tokens,  # "": the supervisor gives it its id
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, stop=stop_sequences(req.stop, stops),
                seed=checked_seed(req.seed), speculative=req.speculative is not False,
                **sampling_options.generate_fields(req))  # top_k, min_p, penalties, logit_bias


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
    plan = ToolPlan(functions=fns, choice=choice, named=named, parallel=req.parallel_tool_calls is True)
    return tools.check_named(plan, "tool_choice")


def _chat_message(i: int, m, found: images.Found) -> p.ChatMessage:
    for name in ("function_call", "audio"):
        if getattr(m, name) is not None:
            raise BodyError(f"messages[{i}].{name}: not supported", param=f"messages[{i}].{name}")
    text, parts = found.content(m.content, f"messages[{i}].content", ("text", "input_text"), images.openai_image)
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
    return p.ChatMessage(role="system" if m.role == "developer" else m.role, content=text, parts=parts,
                         tool_calls=_encoder.encode(calls).decode() if calls else None,
                         tool_call_id=m.tool_call_id)


def chat_generate(req: ChatRequest) -> Planned:
    """OpenAI chat -> Generate with messages (the worker applies the model's chat template)."""
    refuse_unsupported(req)
    _refuse_chat_extras(req)
    if not req.messages:
        raise BodyError("messages: must contain at least one message", param="messages")
    found = images.Found()
    messages = [_chat_message(i, m, found) for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    fmt = response_format_constraint(req.response_format)
    logprobs = sampling_options.chat_logprobs(req.logprobs, req.top_logprobs)
    return planned(p.Generate(messages=messages, constraint=fmt, images=found.images, **common_fields(req, max_tokens),
                              **logprobs), chat_tool_plan(req))


# ---------------------------------------------------------------------------
# the reply, as OpenAI renders it


class Completion:
    """A job's reply as an OpenAI chat or text completion: one JSON body, or SSE chunks.

    A text completion may be one choice of several (`index`, one per prompt, and
    `final` False: the request's last chunks are its own, http/completions.py) and may
    `echo` its prompt before the reply: `prompt` as the client sent it, else (token ids)
    as the worker's `Echoed` decodes it."""

    def __init__(self, job: Job, kind: str, include_usage: bool, *, index: int = 0, echo: bool = False,
                 prompt: str | None = None, final: bool = True, request_id: str = "") -> None:
        self.job = job
        self.kind = kind  # "chat" | "text"
        self.model = job.model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + (request_id or job.gen.request_id)
        self.created = int(time.time())
        self.include_usage = include_usage
        self.index = index
        self.echo = echo
        self.prompt = prompt
        self.final = final
        self._token_frame: tuple[bytes, bytes] | None = None  # see token_chunk
        self._offset = 0  # completions' text_offset of the next token reported
        self.end: p.Finished | None = None  # the worker's end, once rendered

    def echoed(self) -> tuple[str, CompletionLogprobs | None]:
        """The echoed prompt and, with logprobs, its tokens' columns (the first token's are null,
        as OpenAI's); the reply's own offsets then follow it."""
        if not self.echo:
            return "", None
        echoed = self.job.stream.echoed
        text = self.prompt if self.prompt is not None else (echoed.text if echoed is not None else "")
        self._offset = len(text)
        if not self.job.gen.logprobs or echoed is None:
            return text, None
        return text, sampling_options.echo_logprobs(echoed)

    def completion_logprobs(self, items: list[p.TokenLogprobs]) -> CompletionLogprobs:
        """Completions' columns for `items`, their text offsets following the tokens before them."""
        out = sampling_options.completion_choice_logprobs(items, self._offset)
        self._offset += sum(len(item.token) for item in items)
        return out

    async def whole(self, receive: Receive) -> Response:
        text, calls, end = await self.job.collect(receive)
        usage = usage_of(end.finished)
        body: ChatCompletion | TextCompletion
        job = self.job
        if self.kind == "chat":
            message = ChatMessageOut(role="assistant", content=text or (None if calls or job.calls_only else ""))
            if calls or job.calls_only:
                message.tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                                      for c in calls]
            logprobs = sampling_options.chat_choice_logprobs(job.logprobs) if job.gen.logprobs else None
            body = ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
                ChatChoice(index=0, message=message, finish_reason=end.reason, logprobs=logprobs)])
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, usage=usage,
                                  choices=[self.text_choice(text, end)])
        return Response(_encoder.encode(body), media_type="application/json")

    def text_choice(self, text: str, end: End) -> TextChoice:
        """A text completion's choice: the echoed prompt (if asked) and the reply."""
        before, columns = self.echoed()
        logprobs = None
        if self.job.gen.logprobs:
            logprobs = sampling_options.join_logprobs(columns, self.completion_logprobs(self.job.logprobs))
        return TextChoice(index=self.index, text=before + text, finish_reason=end.reason, logprobs=logprobs)

    async def chunks(self, first: StreamReply) -> AsyncIterator[list[bytes]]:
        """A streamed chat or text completion's SSE events, a list per piece: the echoed
        prompt first when asked (as one chunk, its logprobs with it)."""
        out = [self.chunk(None, role=True)] if self.kind == "chat" else []
        if self.echo:
            text, columns = self.echoed()
            out.append(self._text_chunk(text, None, columns))
        async for piece in self.job.pieces(first):
            out.append(self.render(piece))
            yield out
            out = []
        if self.final:
            yield [SSE_DONE]

    def render(self, piece: Piece) -> bytes:
        match piece:
            case Text(text=text):
                if self.job.gen.logprobs:  # the tokens' logprobs ride with their text
                    return self.chunk(text, logprobs=self.job.take_logprobs())
                return self.token_chunk(text) if text else b""  # the hot path: one chunk per token
            case Calls(calls=calls):
                deltas = [ToolCall(index=i, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                          for i, c in enumerate(calls)]
                return self.chunk(None, calls=deltas)
            case ApiError():
                log.info("request %s failed mid-stream: %s: %s", self.id, piece.code, piece.message)
                return b"data: " + piece.body() + b"\n\n"
            case End(finished=fin, reason=reason):
                self.end = fin
                last = self.chunk(None, finish=reason)
                held = self.job.take_logprobs() if self.job.gen.logprobs else []
                if held:  # tokens whose text never came out (held back, or tool calls): theirs before the end
                    last = self.chunk("", logprobs=held) + last
                if self.include_usage and self.final:
                    last += self.usage_chunk(usage_of(fin))
                return last
        return b""

    def chunk(self, text: str | None, *, role: bool = False, finish: ReplyFinishReason | None = None,
              calls: list[ToolCall] | None = None, logprobs: list[p.TokenLogprobs] | None = None) -> bytes:
        usage = None if self.include_usage else msgspec.UNSET
        body: ChatChunk | TextCompletion
        if self.kind == "chat":
            delta = Delta(role="assistant", content="") if role else Delta(content=text, tool_calls=calls)
            choice = ChunkChoice(index=0, delta=delta, finish_reason=finish,
                                 logprobs=None if logprobs is None else sampling_options.chat_choice_logprobs(logprobs))
            body = ChatChunk(id=self.id, created=self.created, model=self.model, usage=usage, choices=[choice])
        else:
            return self._text_chunk(text or "", finish, None if logprobs is None else self.completion_logprobs(logprobs))
        return b"data: " + _encoder.encode(body) + b"\n\n"

    def _text_chunk(self, text: str, finish: ReplyFinishReason | None, logprobs: CompletionLogprobs | None) -> bytes:
        body = TextCompletion(id=self.id, created=self.created, model=self.model,
                              usage=None if self.include_usage else msgspec.UNSET,
                              choices=[TextChoice(index=self.index, text=text, finish_reason=finish, logprobs=logprobs)])
        return b"data: " + _encoder.encode(body) + b"\n\n"

    # -- the per-token hot path ---------------------------------------------------------
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

    def usage_chunk(self, usage: Usage) -> bytes:
        body: ChatChunk | TextCompletion
        if self.kind == "chat":
            body = ChatChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        else:
            body = TextCompletion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return b"data: " + _encoder.encode(body) + b"\n\n"


def usage_of(msg: p.Finished) -> Usage:
    usage = Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
                  total_tokens=msg.prompt_tokens + msg.completion_tokens,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=msg.cached_tokens,
                                                            disk_cached_tokens=msg.cached_disk_tokens))
    if msg.proposed_tokens:
        usage.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=msg.accepted_tokens,
            rejected_prediction_tokens=msg.proposed_tokens - msg.accepted_tokens)
    return usage


async def handle(request: Request, sup: Supervisor, metrics: Metrics, body: bytes, started: float) -> Response:
    """`/v1/chat/completions`: decode, validate, route to the model's worker, answer (JSON or SSE)."""
    req = decode_body(body, ChatRequest)
    work = chat_generate(req)
    images.within_body(len(body), work.gen, sup.config.supervisor)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    if req.stream:
        return await stream_job(request, sup, metrics, req, work, started,
                                lambda job, first: Completion(job, "chat", include_usage).chunks(first))
    job = await open_job(request, sup, metrics, req, work, started)
    return await Completion(job, "chat", include_usage).whole(request.receive)
