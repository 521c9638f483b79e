"""`POST /v1/messages`: the Anthropic Messages API.

The same path as chat completions (a `Generate` with messages, the model's
chat template, the worker's stream), spelled the Anthropic way: `system`
beside the messages, content blocks (`text`, `tool_use`, `tool_result`),
`stop_sequences`, `stop_reason` (`end_turn`, `max_tokens`, `tool_use`), SSE
with named events (`message_start`, `content_block_start`, `ping`,
`content_block_delta`, `content_block_stop`, `message_delta`,
`message_stop`), and errors as `{"type": "error", "error": {"type",
"message"}}` with the status kept: a 507 (the model does not fit, naming
what binds), a 503 with Retry-After, the 400 `prefill_memory_exceeded` all
reach the SDK as the exceptions it raises for those statuses, message intact.

As on the OpenAI side nothing is silently ignored: unknown fields are 400s,
and each field of the SDK's `MessageCreateParams` is honoured, refused
unless neutral, or accepted where it truthfully changes nothing (comments).

A stop string ends the reply with `stop_reason: "stop_sequence"` and the
string itself (the worker's `Finished.stop_sequence`).
"""

from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Literal, Union

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from supervisor.http import tools
from supervisor.http.content import part_text, text_of
from supervisor.http.errors import ApiError
from supervisor.http.job import Calls, End, Job, Text, open_job
from supervisor.http.openai_types import MAX_STOP_SEQUENCES, BodyError, KeepAlive, TopK, decode_body
from supervisor.http.streaming import stream_job

_encoder = msgspec.json.Encoder()


# ---------------------------------------------------------------------------
# request


class Block(Struct, kw_only=True, forbid_unknown_fields=True):
    """One content block of a message, any type (checked by type in `_turns`)."""

    type: str
    text: Union[str, None] = None
    id: Union[str, None] = None  # tool_use
    name: Union[str, None] = None
    input: Union[dict[str, Any], None] = None
    tool_use_id: Union[str, None] = None  # tool_result
    content: Union[str, list["Block"], None] = None
    is_error: Union[bool, None] = None
    cache_control: Any = None  # a caching hint; our prompt cache is automatic (H1)
    citations: Any = None  # refused when set
    source: Any = None  # images, documents: refused by type


class MessageIn(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class AnthropicTool(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    input_schema: Union[dict[str, Any], None] = None
    description: Union[str, None] = None
    type: Union[str, None] = None  # "custom" or absent; server tools are refused
    strict: Union[bool, None] = None
    cache_control: Any = None


class AnthropicToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: Union[str, None] = None
    disable_parallel_tool_use: Union[bool, None] = None


class MessagesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: Annotated[int, Meta(ge=1, le=1_000_000)]
    messages: list[MessageIn]
    system: Union[str, list[Block], None] = None
    stop_sequences: Union[list[str], None] = None
    stream: bool = False
    temperature: Union[Annotated[float, Meta(ge=0.0, le=1.0)], None] = None
    top_p: Union[Annotated[float, Meta(gt=0.0, le=1.0)], None] = None
    top_k: Union[TopK, None] = None  # honoured (0 or null: off)
    tools: Union[list[AnthropicTool], None] = None
    tool_choice: Union[AnthropicToolChoice, None] = None
    # Accepted with no effect on the output, truthfully:
    metadata: Union[dict[str, Any], None] = None  # user_id for abuse tracking; we keep no record
    service_tier: Union[str, None] = None  # one tier here; the output does not depend on it
    cache_control: Any = None  # caching hint; our prompt cache is automatic
    inference_geo: Union[str, None] = None  # where inference runs: on this machine, whatever is asked
    speed: Union[str, None] = None  # a latency class; same output
    user_profile_id: Union[str, None] = None  # account routing ids; nothing to route
    workspace_id: Union[str, None] = None
    # Refused unless null / disabled:
    thinking: Union[dict[str, Any], None] = None
    output_config: Union[dict[str, Any], None] = None
    container: Any = None
    diagnostics: Any = None
    # Per-request idle timers, as on /v1/chat/completions
    keep_alive: KeepAlive = None
    ttl: Union[int, None] = None


def _refuse(req: MessagesRequest) -> None:
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise BodyError("thinking: extended thinking is not supported by these models", param="thinking")
    if req.output_config is not None:
        raise BodyError("output_config: not supported; use a tool with tool_choice for JSON output",
                        param="output_config")
    for name in ("container", "diagnostics"):
        if getattr(req, name) is not None:
            raise BodyError(f"{name}: not supported by this server", param=name)


def _block_text(b: Block, where: str) -> str:
    """The text of a text block at `where`; citations are refused."""
    if b.citations is not None:
        raise BodyError(f"{where}.citations: not supported", param=f"{where}.citations")
    return part_text(b, where, noun="blocks")


def _text_of(content: Union[str, list[Block], None], where: str) -> str:
    """`system` or a tool_result's content: a string or text blocks."""
    if isinstance(content, list):
        return "".join(_block_text(b, f"{where}[{j}]") for j, b in enumerate(content))
    return text_of(content, where)


def _turns(i: int, m: MessageIn) -> list[p.ChatMessage]:
    """One Anthropic message -> chat turns: tool results become `tool` turns, tool uses calls."""
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [p.ChatMessage(role=m.role, content=m.content)]
    turns: list[p.ChatMessage] = []
    text: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(m.content):
        if b.type == "tool_result" and m.role == "user":
            if not b.tool_use_id:
                raise BodyError(f"{where}[{j}].tool_use_id: required", param=f"{where}[{j}].tool_use_id")
            turns.append(p.ChatMessage(role="tool", content=_text_of(b.content, f"{where}[{j}].content"),
                                       tool_call_id=b.tool_use_id))
        elif b.type == "tool_use" and m.role == "assistant":
            if not b.id or not b.name:
                raise BodyError(f"{where}[{j}]: a tool_use block needs id and name", param=f"{where}[{j}]")
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}})
        else:
            text.append(_block_text(b, f"{where}[{j}]"))
    if text or calls:
        turns.append(p.ChatMessage(role=m.role, content="".join(text),
                                   tool_calls=_encoder.encode(calls).decode() if calls else None))
    return turns


def tool_plan(req: MessagesRequest) -> tools.ToolPlan | None:
    if not req.tools and req.tool_choice is None:
        return None
    fns = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise BodyError(f"tools[{i}].type: server tools ({t.type}) are not available here",
                            param=f"tools[{i}].type")
        fns.append(tools.function(t.name, t.description, t.input_schema, t.strict, f"tools[{i}]"))
    tc = req.tool_choice or AnthropicToolChoice(type="auto")
    choice = tools.ANTHROPIC_CHOICES[tc.type]
    if choice == "named" and not tc.name:
        raise BodyError("tool_choice.name: required with type \"tool\"", param="tool_choice.name")
    plan = tools.ToolPlan(functions=fns, choice=choice, named=tc.name or "",
                          parallel=tc.disable_parallel_tool_use is False)
    return tools.check_named(plan, "tool_choice")


def messages_generate(req: MessagesRequest) -> tools.Planned:
    _refuse(req)
    if not req.messages:
        raise BodyError("messages: must contain at least one message", param="messages")
    turns = [p.ChatMessage(role="system", content=_text_of(req.system, "system"))] if req.system else []
    for i, m in enumerate(req.messages):
        turns += _turns(i, m)
    stops = list(req.stop_sequences or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise BodyError(f"stop_sequences: at most {MAX_STOP_SEQUENCES}, none empty", param="stop_sequences")
    gen = p.Generate(request_id="", messages=turns, max_tokens=req.max_tokens,
                     temperature=1.0 if req.temperature is None else req.temperature,
                     top_p=1.0 if req.top_p is None else req.top_p, stop=stops, top_k=req.top_k or 0)
    return tools.planned(gen, tool_plan(req))


# ---------------------------------------------------------------------------
# response


class TextBlock(Struct, kw_only=True, tag="text", tag_field="type"):
    text: str
    citations: None = None


class ToolUseBlock(Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: msgspec.Raw


class AnthropicUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # H1: what the prompt cache supplied (memory and disk)
    cache_creation_input_tokens: int = 0
    disk_cache_read_input_tokens: int = 0  # H5 (proposed): the part of cache_read_input_tokens read from disk


class Message(Struct, kw_only=True):
    id: str
    model: str
    content: list[Union[TextBlock, ToolUseBlock]]
    usage: AnthropicUsage
    stop_reason: Union[str, None] = None
    stop_sequence: Union[str, None] = None
    type: str = "message"
    role: str = "assistant"


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop(end: End) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the worker says which stop string ended the reply."""
    if end.reason == "stop" and end.finished.stop_sequence:
        return "stop_sequence", end.finished.stop_sequence
    return _STOP.get(end.reason, "end_turn"), None


def _usage(fin: p.Finished | None) -> AnthropicUsage:
    if fin is None:
        return AnthropicUsage(input_tokens=0, output_tokens=0)
    return AnthropicUsage(input_tokens=fin.prompt_tokens, output_tokens=fin.completion_tokens,
                          cache_read_input_tokens=fin.cached_tokens,
                          disk_cache_read_input_tokens=fin.cached_disk_tokens)


def _tool_use(c: tools.Call) -> ToolUseBlock:
    return ToolUseBlock(id="toolu_" + c.id.removeprefix("call_"), name=c.name, input=msgspec.Raw(c.arguments.encode()))


def _event(name: str, body: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode({"type": name, **body}) + b"\n\n"


async def handle(request: Request, sup, metrics, body: bytes, started: float) -> Response:
    req = decode_body(body, MessagesRequest)
    work = messages_generate(req)
    if req.stream:  # headers at once, a comment each second while it waits (http/streaming.py)
        return await stream_job(request, sup, metrics, req, work, started,
                                lambda job, first: _events(job, first, "msg_" + job.gen.request_id, req.model),
                                failure=lambda exc: _event("error", {"error": error_detail(exc)}))
    job = await open_job(request, sup, metrics, req, work, started)
    msg_id = "msg_" + job.gen.request_id
    text, calls, end = await job.collect(request.receive)
    # a required call cut before it closed: no block at all (half a call is no call), stop_reason max_tokens
    content: list[Union[TextBlock, ToolUseBlock]] = (
        [TextBlock(text=text)] if text or not (calls or job.calls_only) else [])
    content += [_tool_use(c) for c in calls]
    reason, sequence = _stop(end)
    reply = Message(id=msg_id, model=req.model, content=content, usage=_usage(end.finished),
                    stop_reason=reason, stop_sequence=sequence)
    return Response(_encoder.encode(reply), media_type="application/json")


async def _events(job: Job, first, msg_id: str, model: str) -> AsyncIterator[list[bytes]]:
    """Anthropic's event sequence, a list per piece for `Job.streamed`; a text block opens at
    the first text, a tool_use block per call. message_start reports the prompt's tokens and
    one output token, as Anthropic's does: the worker's `Prompted` (the prompt's final length) always comes
    before the first token, so by `first` the stream holds the count."""
    prompted = job.stream.prompted
    start = Message(id=msg_id, model=model, content=[], usage=AnthropicUsage(
        input_tokens=prompted.prompt_tokens if prompted else 0, output_tokens=1,
        cache_read_input_tokens=prompted.cached_tokens if prompted else 0,
        disk_cache_read_input_tokens=prompted.cached_disk_tokens if prompted else 0))
    out = [_event("message_start", {"message": start}), _event("ping", {})]
    index, text_open = 0, False
    async for piece in job.pieces(first):
        match piece:
            case Text(text=t):
                if not text_open:
                    out.append(_event("content_block_start", {"index": index, "content_block": TextBlock(text="")}))
                    text_open = True
                out.append(_event("content_block_delta", {"index": index,
                                                          "delta": {"type": "text_delta", "text": t}}))
            case Calls(calls=calls):
                if text_open:
                    out.append(_event("content_block_stop", {"index": index}))
                    index, text_open = index + 1, False
                for c in calls:
                    block = _tool_use(c)
                    out.append(_event("content_block_start", {"index": index, "content_block": {
                        "type": "tool_use", "id": block.id, "name": c.name, "input": {}}}))
                    out.append(_event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": c.arguments}}))
                    out.append(_event("content_block_stop", {"index": index}))
                    index += 1
            case End(finished=fin):
                if text_open:
                    out.append(_event("content_block_stop", {"index": index}))
                usage = _usage(fin)
                stop_reason, sequence = _stop(piece)
                out.append(_event("message_delta", {
                    "delta": {"stop_reason": stop_reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": usage.output_tokens, "input_tokens": usage.input_tokens,
                              "cache_read_input_tokens": usage.cache_read_input_tokens,
                              "disk_cache_read_input_tokens": usage.disk_cache_read_input_tokens}}))
                out.append(_event("message_stop", {}))
            case ApiError():
                out.append(_event("error", {"error": error_detail(piece)}))
        yield out
        out = []


# ---------------------------------------------------------------------------
# token counting


class CountTokensRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/messages/count_tokens`: the Messages request less what only shapes the
    output (max_tokens, sampling, stop sequences, stream)."""

    model: str
    messages: list[MessageIn]
    system: Union[str, list[Block], None] = None
    tools: Union[list[AnthropicTool], None] = None
    tool_choice: Union[AnthropicToolChoice, None] = None
    thinking: Union[dict[str, Any], None] = None
    cache_control: Any = None  # a caching hint, as on /v1/messages
    output_config: Union[dict[str, Any], None] = None
    keep_alive: KeepAlive = None
    ttl: Union[int, None] = None


async def prompt_tokens(request: Request, sup, metrics, req, gen: p.Generate, started: float) -> int:
    """How many tokens the worker's chat template makes of `gen`'s prompt.

    Why a generation: only the worker holds the tokenizer and the chat template (the
    supervisor never imports MLX, nor the tokenizer stack), and the protocol has no
    tokenize command; the worker's `Prompted` is the exact count. The probe
    runs under the guard like any request and is aborted as soon as the count is in,
    when its prefill starts: no output token is made and at most one chunk prefilled."""
    probe = p.Generate(request_id="", messages=gen.messages, prompt=gen.prompt, max_tokens=1,
                       temperature=0.0, tools=gen.tools)
    job = await open_job(request, sup, metrics, req, tools.Planned(probe), started)
    prompted = await job.prompt(request.receive)
    if prompted is None:  # refused before its prefill (G1, context): collect raises the worker's error
        _text, _calls, end = await job.collect(request.receive)
        return end.finished.prompt_tokens
    job.cancel("count_tokens: the prompt is counted")
    return prompted.prompt_tokens


async def count_tokens(request: Request, sup, metrics, body: bytes, started: float) -> Response:
    """`{"input_tokens": N}`: the prompt's tokens under the model's chat template."""
    c = decode_body(body, CountTokensRequest)
    req = MessagesRequest(model=c.model, max_tokens=1, messages=c.messages, system=c.system, tools=c.tools,
                          tool_choice=c.tool_choice, thinking=c.thinking, output_config=c.output_config,
                          keep_alive=c.keep_alive, ttl=c.ttl)
    tokens = await prompt_tokens(request, sup, metrics, req, messages_generate(req).gen, started)
    return Response(_encoder.encode({"input_tokens": tokens}), media_type="application/json")


# ---------------------------------------------------------------------------
# errors


_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "request_too_large", 415: "invalid_request_error", 421: "permission_error", 429: "rate_limit_error", 503: "overloaded_error"}


def error_detail(exc: ApiError) -> dict:
    """Anthropic's error object; memvisor's figures (binding, bytes) ride along as extra keys."""
    return {"type": _ERROR_TYPE.get(exc.status, "api_error"), "message": exc.message, **exc.tagged()}


def error_response(exc: ApiError) -> Response:
    body = _encoder.encode({"type": "error", "error": error_detail(exc)})
    return Response(body, status_code=exc.status, headers=exc.headers, media_type="application/json")

