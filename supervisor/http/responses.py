"""`POST /v1/responses`: OpenAI's Responses API, stateless.

`input` as text or as items (messages with text parts, earlier
`function_call`s and their `function_call_output`s), `instructions` as the
system turn, `max_output_tokens`, function tools and tool_choice,
`text.format` (json_object / json_schema by constrained decoding), and
streaming as the typed events the openai SDK reads (`response.created`,
`response.output_text.delta`, `response.function_call_arguments.delta`,
`response.completed`, ...). Errors keep OpenAI's shape and status, so the
guard's 507, 503 + Retry-After and 400 `prefill_memory_exceeded` reach
`responses.create` as the SDK's exceptions, message intact.

Nothing is stored: `store: true`, `previous_response_id`, `conversation`
and `background` are refused rather than pretended.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Union

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from supervisor.http import images, sampling_options, tools
from supervisor.http.content import text_of
from supervisor.http.errors import ApiError
from supervisor.http.job import Calls, End, Job, Text, open_job
from supervisor.http.openai_types import (
    DEFAULT_CHAT_MAX_TOKENS,
    BodyError,
    ContentPart,
    JsonSchemaFormat,
    KeepAlive,
    LogprobOut,
    MaxTokens,
    SamplingFields,
    Temperature,
    TopP,
    decode_body,
)
from supervisor.http.streaming import stream_job

_encoder = msgspec.json.Encoder()


class Item(Struct, kw_only=True, forbid_unknown_fields=True):
    """An input item: a message (role + content), a function_call or a function_call_output."""

    type: str = "message"
    role: Union[str, None] = None
    content: Union[str, list[ContentPart], None] = None
    id: Union[str, None] = None
    status: Union[str, None] = None
    call_id: Union[str, None] = None
    name: Union[str, None] = None
    arguments: Union[str, None] = None
    output: Union[str, list[ContentPart], None] = None


class FunctionTool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: Union[str, None] = None
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class TextFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: Union[str, None] = None
    description: Union[str, None] = None
    schema: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class TextConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    format: Union[TextFormat, None] = None
    verbosity: Union[str, None] = None  # refused unless null


class ResponsesRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: Union[str, list[Item]]
    instructions: Union[str, None] = None
    max_output_tokens: Union[MaxTokens, None] = None
    temperature: Union[Temperature, None] = None
    top_p: Union[TopP, None] = None
    stream: bool = False
    tools: Union[list[FunctionTool], None] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Union[bool, None] = None
    text: Union[TextConfig, None] = None
    # Accepted with no effect on the output, truthfully:
    metadata: Union[dict[str, str], None] = None  # kept with stored responses; we store none
    user: Union[str, None] = None  # abuse tracking ids
    safety_identifier: Union[str, None] = None
    prompt_cache_key: Union[str, None] = None  # caching hints; our prompt cache is automatic (H1)
    prompt_cache_retention: Union[str, None] = None
    prompt_cache_options: Any = None
    service_tier: Union[str, None] = None  # one tier here
    stream_options: Union[dict[str, Any], None] = None  # include_obfuscation: nothing to pad
    truncation: Union[str, None] = None  # "disabled" only (the default): too long is an error
    include: Union[list[str], None] = None  # only "message.output_text.logprobs"
    store: Union[bool, None] = None  # false/null only
    # Refused unless null:
    previous_response_id: Union[str, None] = None
    conversation: Any = None
    background: Union[bool, None] = None
    background_options: Any = None
    reasoning: Any = None
    prompt: Any = None
    max_tool_calls: Union[int, None] = None
    top_logprobs: Union[int, None] = None  # honoured (0-20 alternatives per token)
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None
    image: Any = None
    keep_alive: KeepAlive = None
    ttl: Union[int, None] = None


_REFUSED = ("previous_response_id", "conversation", "background", "background_options", "reasoning", "prompt",
            "max_tool_calls", "context_management", "moderation", "access_programs", "image")


def _refuse(req: ResponsesRequest) -> None:
    if req.store:
        raise BodyError("store: this server stores no responses (send store: false)", param="store")
    if req.truncation not in (None, "disabled"):
        raise BodyError("truncation: only \"disabled\"; a too-long input is an error", param="truncation")
    for i, extra in enumerate(req.include or []):
        if extra != LOGPROBS:
            raise BodyError(f"include[{i}]: only {LOGPROBS!r} can be included (got {extra!r})", param="include")
    if req.text is not None and req.text.verbosity is not None:
        raise BodyError("text.verbosity: not supported", param="text.verbosity")
    for name in _REFUSED:
        value = getattr(req, name)
        if value is not None and value is not False:
            raise BodyError(f"{name}: not supported by this (stateless) server", param=name)


_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"


def _logprobs(req: ResponsesRequest) -> dict[str, Any]:
    """Logprobs for `include: ["message.output_text.logprobs"]` or a `top_logprobs`."""
    if LOGPROBS not in (req.include or []) and req.top_logprobs is None:
        return {}
    return sampling_options.chat_logprobs(True, req.top_logprobs)


def _messages(req: ResponsesRequest, found: images.Found) -> list[p.ChatMessage]:
    turns = [p.ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return turns + [p.ChatMessage(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise BodyError(f"{where}.role: {item.role!r} is not a message role", param=f"{where}.role")
            role = "system" if item.role == "developer" else item.role
            text, parts = found.content(item.content, f"{where}.content", _TEXT_PARTS, images.responses_image)
            turns.append(p.ChatMessage(role=role, content=text, parts=parts))
        elif item.type == "function_call":
            try:
                args = msgspec.json.decode(item.arguments or "{}")
            except msgspec.DecodeError:
                raise BodyError(f"{where}.arguments: not valid JSON", param=f"{where}.arguments") from None
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
            turns.append(p.ChatMessage(role="assistant", content="", tool_calls=_encoder.encode([call]).decode()))
        elif item.type == "function_call_output":
            if not item.call_id:
                raise BodyError(f"{where}.call_id: required", param=f"{where}.call_id")
            turns.append(p.ChatMessage(role="tool", content=text_of(item.output, f"{where}.output", _TEXT_PARTS),
                                       tool_call_id=item.call_id))
        else:
            raise BodyError(f"{where}.type: {item.type!r} items are not supported", param=f"{where}.type")
    if not turns:
        raise BodyError("input: must not be empty", param="input")
    return turns


def tool_plan(req: ResponsesRequest) -> tools.ToolPlan | None:
    if not req.tools and req.tool_choice in (None, "none", "auto"):
        return None
    fns = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise BodyError(f"tools[{i}].type: only function tools are available here (got {t.type!r})",
                            param=f"tools[{i}].type")
        fns.append(tools.function(t.name, t.description, t.parameters, t.strict, f"tools[{i}]"))
    choice, named = tools.openai_choice(req.tool_choice, nested=False)
    plan = tools.ToolPlan(functions=fns, choice=choice, named=named, parallel=req.parallel_tool_calls is True)
    return tools.check_named(plan, "tool_choice")


def _format(req: ResponsesRequest) -> p.ConstraintSpec | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return p.JsonObject()
    if fmt.type != "json_schema":
        raise BodyError(f"text.format.type: {fmt.type!r} is not text, json_object or json_schema",
                        param="text.format.type")
    js = JsonSchemaFormat(name=fmt.name or "output", schema=fmt.schema, strict=fmt.strict)
    if js.schema is None:
        raise BodyError("text.format.schema: a json_schema format needs its schema", param="text.format.schema")
    return p.JsonSchema(schema=_encoder.encode(js.schema).decode(), strict=bool(js.strict), name=js.name)


def responses_generate(req: ResponsesRequest) -> tools.Planned:
    _refuse(req)
    found = images.Found()
    gen = p.Generate(request_id="", messages=_messages(req, found), images=found.images,
                     max_tokens=req.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
                     temperature=1.0 if req.temperature is None else req.temperature,
                     top_p=1.0 if req.top_p is None else req.top_p, constraint=_format(req),
                     **sampling_options.generate_fields(req), **_logprobs(req))
    return tools.planned(gen, tool_plan(req))


# ---------------------------------------------------------------------------
# response objects


class OutputText(Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list = []
    logprobs: Union[list[LogprobOut], msgspec.UnsetType] = msgspec.UNSET  # when asked for


class MessageItem(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallItem(Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class InputDetails(Struct, kw_only=True):
    cached_tokens: int = 0       # H1: from the prompt cache, memory and disk
    disk_cached_tokens: int = 0  # H5 (proposed): the part read back from the disk tier


class OutputDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponsesUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputDetails
    output_tokens_details: OutputDetails = msgspec.field(default_factory=OutputDetails)


class Incomplete(Struct, kw_only=True):
    reason: str


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[Union[MessageItem, FunctionCallItem]]
    usage: Union[ResponsesUsage, None] = None
    incomplete_details: Union[Incomplete, None] = None
    instructions: Union[str, None] = None
    max_output_tokens: Union[int, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list = []
    error: Union[dict, None] = None  # {"code", "message"} on a failed response
    metadata: dict = {}
    object: str = "response"
    store: bool = False


def _usage(fin: p.Finished) -> ResponsesUsage:
    return ResponsesUsage(input_tokens=fin.prompt_tokens, output_tokens=fin.completion_tokens,
                          total_tokens=fin.prompt_tokens + fin.completion_tokens,
                          input_tokens_details=InputDetails(cached_tokens=fin.cached_tokens,
                                                            disk_cached_tokens=fin.cached_disk_tokens))


def _call_item(c: tools.Call, arguments: str | None = None) -> FunctionCallItem:
    return FunctionCallItem(id="fc_" + c.id.removeprefix("call_"), call_id=c.id, name=c.name,
                            arguments=c.arguments if arguments is None else arguments,
                            status="completed" if arguments is None else "in_progress")


class Shell:
    """The response's fixed fields, and the whole object at each stage."""

    def __init__(self, req: ResponsesRequest, resp_id: str) -> None:
        self.req, self.id, self.created = req, resp_id, int(time.time())

    def build(self, status: str, output: list, fin: p.Finished | None = None, reason: str = "") -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.created, model=req.model, status=status, output=output,
            usage=_usage(fin) if fin is not None else None,
            incomplete_details=Incomplete(reason="max_output_tokens") if reason == "length" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice or "auto", metadata=req.metadata or {},
            tools=[msgspec.to_builtins(t) for t in req.tools or []])


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


async def handle(request: Request, sup, metrics, body: bytes, started: float) -> Response:
    req = decode_body(body, ResponsesRequest)
    work = responses_generate(req)
    images.within_body(len(body), work.gen, sup.config.supervisor)
    if req.stream:  # headers at once, a comment each second while it waits (http/streaming.py)
        return await stream_job(request, sup, metrics, req, work, started,
                                lambda job, first: _events(job, first, Shell(req, "resp_" + job.gen.request_id)),
                                format_param="text.format")
    job = await open_job(request, sup, metrics, req, work, started, format_param="text.format")
    gen = job.gen
    shell = Shell(req, "resp_" + gen.request_id)
    text, calls, end = await job.collect(request.receive)
    output: list[Union[MessageItem, FunctionCallItem]] = []
    if text or not (calls or job.calls_only):  # a required call cut before it closed: no item (half a call is no call)
        part = OutputText(text=text, logprobs=_logprobs_out(job, job.logprobs))
        output.append(MessageItem(id="msg_" + gen.request_id, content=[part], status=_status(end.reason)))
    output += [_call_item(c) for c in calls]
    reply = shell.build(_status(end.reason), output, end.finished, end.reason)
    return Response(_encoder.encode(reply), media_type="application/json")


def _logprobs_out(job: Job, items: list[p.TokenLogprobs]) -> Union[list[LogprobOut], msgspec.UnsetType]:
    """An output_text's (or a delta's) logprobs, when the request asked for them."""
    return [sampling_options.logprob_out(item) for item in items] if job.gen.logprobs else msgspec.UNSET


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **body) -> bytes:
        data = _encoder.encode({"type": kind, "sequence_number": self.seq, **body})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def _events(job: Job, first, shell: Shell) -> AsyncIterator[list[bytes]]:
    """The Responses event sequence, a list per piece for `Job.streamed`."""
    ev = _Events()
    out = [ev("response.created", response=shell.build("in_progress", [])),
           ev("response.in_progress", response=shell.build("in_progress", []))]
    output: list[Union[MessageItem, FunctionCallItem]] = []
    msg_id = "msg_" + job.gen.request_id
    text: list[str] | None = None  # the open message item's text
    async for piece in job.pieces(first):
        match piece:
            case Text(text=t):
                if text is None:
                    text = []
                    out += _open_message(ev, len(output), msg_id)
                text.append(t)
                out.append(ev("response.output_text.delta", item_id=msg_id, output_index=len(output),
                              content_index=0, delta=t, logprobs=_logprobs_out(job, job.take_logprobs()) or []))
            case Calls(calls=calls):
                if text is not None:
                    output.append(_close_message(ev, out, len(output), msg_id, "".join(text), "completed",
                                                  _logprobs_out(job, job.logprobs)))
                    text = None
                for c in calls:
                    out += _call_events(ev, len(output), c)
                    output.append(_call_item(c))
            case End(finished=fin, reason=reason):
                if text is None and not output and not job.calls_only:
                    text = []
                    out += _open_message(ev, 0, msg_id)
                if text is not None:
                    output.append(_close_message(ev, out, len(output), msg_id, "".join(text), _status(reason),
                                                  _logprobs_out(job, job.logprobs)))
                done = "response.incomplete" if reason == "length" else "response.completed"
                out.append(ev(done, response=shell.build(_status(reason), output, fin, reason)))
            case ApiError():
                out.append(ev("error", code=piece.code, message=piece.message, param=piece.param))
                failed = shell.build("failed", output)
                failed.error = {"code": piece.code or "server_error", "message": piece.message}
                out.append(ev("response.failed", response=failed))
        yield out
        out = []


def _open_message(ev: _Events, index: int, msg_id: str) -> list[bytes]:
    item = MessageItem(id=msg_id, content=[], status="in_progress")
    return [ev("response.output_item.added", output_index=index, item=item),
            ev("response.content_part.added", item_id=msg_id, output_index=index, content_index=0,
               part=OutputText(text=""))]


def _close_message(ev: _Events, out: list[bytes], index: int, msg_id: str, text: str, status: str,
                   logprobs: Union[list[LogprobOut], msgspec.UnsetType] = msgspec.UNSET) -> MessageItem:
    part = OutputText(text=text, logprobs=logprobs)
    item = MessageItem(id=msg_id, content=[part], status=status)
    out += [ev("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=text,
               logprobs=logprobs or []),
            ev("response.content_part.done", item_id=msg_id, output_index=index, content_index=0, part=part),
            ev("response.output_item.done", output_index=index, item=item)]
    return item


def _call_events(ev: _Events, index: int, c: tools.Call) -> list[bytes]:
    item = _call_item(c)
    return [ev("response.output_item.added", output_index=index, item=_call_item(c, arguments="")),
            ev("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=c.arguments),
            ev("response.function_call_arguments.done", item_id=item.id, output_index=index, name=c.name,
               arguments=c.arguments),
            ev("response.output_item.done", output_index=index, item=item)]


def error_response(exc: ApiError) -> Response:
    return exc.response()
