"""The Ollama API on the same port: `/api/chat` and `/api/generate`
(http/ollama_models.py: `/api/version`, `/api/tags`, `/api/ps`, `/api/show`).

Why: Open WebUI's Ollama connection, Continue, VS Code's Ollama provider and the
official `ollama` Python client speak this API and not OpenAI's. It is the same
path as `/v1/chat/completions` (http/job.py: `open_stream`, `Job.pieces`),
spelled Ollama's way:

- streaming is the default and is NDJSON (one JSON object a line), not SSE;
  `"stream": false` gives one object. The last object carries `done: true`,
  `done_reason`, and the timings in nanoseconds (`total_duration`,
  `load_duration`: the load and queue wait, `prompt_eval_duration`: to the
  first token, `eval_duration`: the rest) with `prompt_eval_count` /
  `eval_count`;
- `options` map to the same sampling settings (http/ollama_options.py: `temperature`, `top_p`,
  `top_k`, `min_p`, `num_predict`, `stop`, `seed`, `repeat_penalty`,
  `presence_penalty` and `frequency_penalty` over the last `repeat_last_n`
  tokens), with Ollama's defaults; `logprobs` / `top_logprobs`
  add Ollama's `logprobs` list to each streamed object and to the whole
  reply. An option the worker cannot honour is a 400 naming it, never
  ignored (as on the OpenAI routes). `num_ctx` and the
  placement options (`num_thread`, `num_gpu`, ...) are accepted: the model
  always runs with its whole context, the guard bounds its memory and the
  worker places the work, none of which changes the tokens;
- `format` ("json" or a JSON schema) is the worker's constrained decoding;
  `tools` go to the chat template and calls come back as Ollama's
  `tool_calls` with `arguments` as an object;
- `/api/generate`'s `suffix` fills in the middle on a model whose tokenizer has
  FIM tokens (its `/api/show` lists `insert`); elsewhere it is a 400 naming it;
- `keep_alive` is Ollama's (the strict parser of keepalive.py); an empty
  `prompt` / `messages` only loads the model (`done_reason: "load"`), or with
  `keep_alive: 0` unloads it (`"unload"`), as Ollama does, under the admin
  route's rule: an admin's unload drains the worker now, anyone else's lets the
  model go once idle, and a pinned model is an admin's alone (403, `forbidden`,
  the model stays loaded; docs/access.md);
- errors are `{"error": "..."}` with the status kept: 404 for an unknown model,
  400 for bad input (and SPEC G1's `prefill_memory_exceeded`), 507 when the
  model does not fit, 503 with Retry-After under pressure; memvisor's figures
  (`code`, `binding`, bytes) ride along as extra keys.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Literal, Union

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http import images, tools
from supervisor.http import sampling_options as openai_sampling
from supervisor.http.errors import ApiError, from_serve_error
from supervisor.http.job import Calls, End, Job, Text, open_stream, race_client
from supervisor.http.keepalive import UNLOAD_NOW, is_admin, keep_alive_seconds
from supervisor.http.metrics import Metrics
from supervisor.http.modelfacts import require_fim
from supervisor.http.ollama_models import now_rfc3339, resolve
from supervisor.http.ollama_options import sampling
from supervisor.http.openai_types import (
    BodyError,
    KeepAlive,
    LogprobOut,
    decode_body,
)
from supervisor.http.streaming import Early, Waiting, never
from supervisor.workers.streams import StreamReply

_encoder = msgspec.json.Encoder()


# ---------------------------------------------------------------------------
# requests


class OllamaFunctionCall(Struct, kw_only=True):
    name: str
    arguments: Union[dict[str, Any], str] = {}
    index: Union[int, None] = None


class OllamaToolCall(Struct, kw_only=True):
    function: OllamaFunctionCall
    id: Union[str, None] = None
    type: Union[str, None] = None


class OllamaMessage(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, None] = ""
    images: Union[list[Any], None] = None  # base64 images, for a vision model (http/images.py)
    thinking: Union[str, None] = None  # an earlier turn's reasoning: history only, templates do not render it
    tool_calls: Union[list[OllamaToolCall], None] = None
    tool_name: Union[str, None] = None  # a tool turn: the function it answers
    tool_call_id: Union[str, None] = None


class _Common(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool = True
    options: Union[dict[str, Any], None] = None
    format: Union[str, dict[str, Any], None] = None
    keep_alive: KeepAlive = None
    think: Union[bool, str, None] = None  # refused unless false: these models do not reason
    logprobs: Union[bool, None] = None  # honoured
    top_logprobs: Union[int, None] = None


class OllamaChatRequest(_Common, kw_only=True):
    messages: Union[list[OllamaMessage], None] = None
    tools: Union[list[dict[str, Any]], None] = None


class OllamaGenerateRequest(_Common, kw_only=True):
    prompt: Union[str, None] = None
    system: Union[str, None] = None
    suffix: Union[str, None] = None  # fill in the middle, on models with FIM tokens
    template: Union[str, None] = None  # refused: the model's own template is used
    context: Union[list[int], None] = None  # refused: send the conversation instead
    raw: Union[bool, None] = None  # true: the prompt goes to the model as is
    images: Union[list[Any], None] = None
    width: Union[int, None] = None  # image generation: refused when set
    height: Union[int, None] = None
    steps: Union[int, None] = None


def format_constraint(fmt: str | dict[str, Any] | None) -> p.ConstraintSpec | None:
    """Ollama's `format`: "json" or a JSON schema -> the worker's constrained decoding."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return p.JsonObject()
    if isinstance(fmt, dict):
        return p.JsonSchema(schema=_encoder.encode(fmt).decode(), strict=True, name="format")
    raise BodyError(f"format: \"json\" or a JSON schema object, got {fmt!r}", param="format")


def _refuse_common(req: _Common) -> None:
    if req.think not in (None, False, "", "false"):
        raise BodyError("think: these models do not reason (only false)", param="think")


def _sampling(req: _Common) -> dict[str, Any]:
    """The Generate fields of the request's options and its logprobs."""
    return {**msgspec.structs.asdict(sampling(req.options)),
            **openai_sampling.chat_logprobs(bool(req.logprobs), req.top_logprobs)}


def tool_plan(raw: list[dict[str, Any]] | None) -> tools.ToolPlan | None:
    """Ollama's tools are OpenAI's chat tools; Ollama has no tool_choice (always auto)."""
    if not raw:
        return None
    fns = []
    for i, t in enumerate(raw):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise BodyError(f"tools[{i}]: only function tools ({{\"type\": \"function\", \"function\": "
                            "{...}}) are supported", param=f"tools[{i}]")
        fns.append(tools.function(fn.get("name"), fn.get("description"), fn.get("parameters"), False,
                                  f"tools[{i}].function"))
    return tools.ToolPlan(functions=fns, choice="auto")


def chat_messages(messages: list[OllamaMessage], found: images.Found) -> list[p.ChatMessage]:
    """Ollama turns -> chat turns. Ollama's calls have no ids and a tool turn names its
    function, not its call: ids are made up and a tool turn answers the oldest open call."""
    out: list[p.ChatMessage] = []
    open_calls: list[tuple[str, str]] = []  # (id, function name) of calls not answered yet
    for i, m in enumerate(messages):
        calls = None
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = msgspec.json.decode(args)
                    except msgspec.DecodeError:
                        where = f"messages[{i}].tool_calls[{j}].function.arguments"
                        raise BodyError(f"{where}: not valid JSON", param=where) from None
                call_id = c.id or f"call_{i}_{j}"
                open_calls.append((call_id, c.function.name))
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
        answers = None
        if m.role == "tool":
            answers = m.tool_call_id
            if answers is None and open_calls:
                match = next((k for k, (_, name) in enumerate(open_calls) if name == m.tool_name), 0)
                answers = open_calls.pop(match)[0]
            answers = answers or m.tool_name or "call_0"
        out.append(p.ChatMessage(role=m.role, content=m.content or "",
                                 parts=found.leading(m.images, f"messages[{i}].images", m.content or ""),
                                 tool_calls=_encoder.encode(calls).decode() if calls else None,
                                 tool_call_id=answers))
    return out


def chat_generate(req: OllamaChatRequest) -> tools.Planned:
    _refuse_common(req)
    found = images.Found()
    gen = p.Generate(request_id="", messages=chat_messages(req.messages or [], found), images=found.images,
                     constraint=format_constraint(req.format), **_sampling(req))
    return tools.planned(gen, tool_plan(req.tools))


def generate_generate(req: OllamaGenerateRequest) -> tools.Planned:
    _refuse_common(req)
    if req.suffix and req.system:
        raise BodyError("system: a fill-in-the-middle prompt (suffix) has no system turn", param="system")
    if req.template:
        raise BodyError("template: the model's own chat template is used; send raw=true to skip it",
                        param="template")
    if req.context:
        raise BodyError("context: token contexts are not kept; send the conversation to /api/chat",
                        param="context")
    if req.images and (req.suffix or req.raw):
        raise BodyError("images: a raw or fill-in-the-middle prompt cannot carry images", param="images")
    for name in ("width", "height", "steps"):
        if getattr(req, name) is not None:
            raise BodyError(f"{name}: image generation is not supported (these are text models)", param=name)
    common = dict(request_id="", constraint=format_constraint(req.format), **_sampling(req))
    if req.suffix:  # the worker builds the prompt from its FIM tokens, no template
        return tools.Planned(p.Generate(prompt=req.prompt or "", suffix=req.suffix, **common))
    if req.raw:
        if req.system:
            raise BodyError("system: raw prompts go to the model as they are; put the system text in the prompt",
                            param="system")
        return tools.Planned(p.Generate(prompt=req.prompt or "", **common))
    turns = [p.ChatMessage(role="system", content=req.system)] if req.system else []
    found = images.Found()
    turns.append(p.ChatMessage(role="user", content=req.prompt or "",
                               parts=found.leading(req.images, "images", req.prompt or "")))
    return tools.Planned(p.Generate(messages=turns, images=found.images, **common))


# ---------------------------------------------------------------------------
# responses


class Timings:
    """Ollama's durations (ns), from the request's arrival, the stream's opening (the
    load and queue are behind it) and its first token."""

    def __init__(self, started: float, opened: float) -> None:
        self.started = started
        self.opened = opened

    def stats(self, job: Job, fin: p.Finished) -> dict[str, int]:
        end = time.monotonic()
        first = job.stream.first_token or end
        ns = 1_000_000_000
        return {"total_duration": int((end - self.started) * ns),
                "load_duration": int(max(0.0, self.opened - self.started) * ns),
                "prompt_eval_count": fin.prompt_tokens,
                "prompt_eval_duration": int(max(0.0, first - job.stream.created) * ns),
                "eval_count": fin.completion_tokens,
                "eval_duration": int(max(0.0, end - first) * ns)}


def _calls_out(calls: list[tools.Call]) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        try:
            args = msgspec.json.decode(c.arguments)
        except msgspec.DecodeError:
            args = {}
        out.append({"id": c.id, "function": {"index": i, "name": c.name, "arguments": args}})
    return out


def _line(body: dict) -> bytes:
    return _encoder.encode(body) + b"\n"


def done_reason(end: End) -> str:
    """Ollama's done_reason: "stop" (also when the reply was tool calls) or "length"."""
    return "length" if end.reason == "length" else "stop"


async def _run(request: Request, sup: Supervisor, metrics: Metrics, req: _Common, work: tools.Planned,
               started: float, *, chat: bool, empty: bool) -> Response:
    """One Ollama generation; `empty` (no messages, no prompt) only loads or unloads."""
    model = resolve(sup, req.model)
    keep = keep_alive_seconds(req.keep_alive, None)
    if empty:
        return await _load_only(request, sup, req.model, model, keep, chat)
    if req.stream:
        return await _streamed(request, sup, metrics, req, work, started, model, keep, chat)
    stream = await open_stream(sup, model, work.gen, request.receive, keep)
    timings = Timings(started, time.monotonic())
    job = Job(sup, metrics, model, work.gen, started, stream, work.plan, "format")
    text, calls, end = await job.collect(request.receive)
    body: dict[str, Any] = {"model": req.model, "created_at": now_rfc3339()}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = _calls_out(calls)
        body["message"] = message
    else:
        body["response"] = text
    body.update(done=True, done_reason=done_reason(end), **timings.stats(job, end.finished))
    if job.gen.logprobs:
        body["logprobs"] = _logprobs(job.logprobs)
    return Response(_encoder.encode(body), media_type="application/json")


async def _streamed(request: Request, sup: Supervisor, metrics: Metrics, req: _Common, work: tools.Planned,
                    started: float, model: str, keep: float | None, chat: bool) -> Response:
    """NDJSON, its headers at once (http/streaming.py); while the request waits (a load, the
    queue, a long prefill) an empty chunk each second: Ollama's clients parse every line as
    JSON, so an empty line or a comment would break them, and an empty chunk adds nothing."""
    waiting = Waiting(sup, model)

    async def start() -> tuple[Job, Timings, StreamReply]:
        stream = await open_stream(sup, model, work.gen, never, keep)
        waiting.streams.append(stream)
        timings = Timings(started, time.monotonic())
        job = Job(sup, metrics, model, work.gen, started, stream, work.plan, "format")
        return job, timings, await job.first(never)

    def idle() -> bytes:
        head: dict[str, Any] = {"model": req.model, "created_at": now_rfc3339()}
        head.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return _line({**head, "done": False})

    early = Early(start(), lambda ready: ready[0].sse_body(_lines(ready[0], ready[2], req.model, chat, ready[1])),
                  idle=idle, failure=lambda exc: _line(error_body(exc)),
                  discard=lambda ready: ready[0].cancel("client disconnected"), media_type="application/x-ndjson")
    return await early.response(request.receive)


def _logprobs(items: list[p.TokenLogprobs]) -> list[LogprobOut]:
    """Ollama's `logprobs`: per token its text, logprob, bytes and top_logprobs (OpenAI's chat items)."""
    return [openai_sampling.logprob_out(item) for item in items]


async def _load_only(request: Request, sup: Supervisor, name: str, model: str, keep: float | None,
                     chat: bool) -> Response:
    """Ollama's empty request: load the model (or, with keep_alive 0, unload it)."""
    if keep == UNLOAD_NOW:  # an unload: who may is the admin route's rule (keepalive.py)
        admin = is_admin(request, sup.config.supervisor.admin_token)
        try:
            await sup.unload(model, "unloaded by an Ollama keep_alive: 0 request", admin=admin)
        except ServeError as exc:
            raise from_serve_error(exc) from None
        reason = "unload"
    else:
        try:
            await race_client(sup.load(model, explicit=True), request.receive)
        except ServeError as exc:
            raise from_serve_error(exc) from None
        if keep is not None:
            sup.keep_alive(model, keep)
        reason = "load"
    body: dict[str, Any] = {"model": name, "created_at": now_rfc3339(), "done": True, "done_reason": reason}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return Response(_encoder.encode(body), media_type="application/json")


async def _lines(job: Job, first, name: str, chat: bool, timings: Timings) -> AsyncIterator[list[bytes]]:
    """The NDJSON objects of a streamed reply, a list per piece (for `Job.sse_body`,
    which writes bytes whatever their framing)."""
    async for piece in job.pieces(first):
        head: dict[str, Any] = {"model": name, "created_at": now_rfc3339()}
        match piece:
            case Text(text=t):
                if not t:
                    continue
                head.update({"message": {"role": "assistant", "content": t}} if chat else {"response": t})
                if job.gen.logprobs:
                    head["logprobs"] = _logprobs(job.take_logprobs())
                yield [_line({**head, "done": False})]
            case Calls(calls=calls):
                head.update({"message": {"role": "assistant", "content": "", "tool_calls": _calls_out(calls)}}
                            if chat else {"response": ""})
                yield [_line({**head, "done": False})]
            case End(finished=fin):
                head.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
                if job.gen.logprobs:  # tokens whose text never came out (held back, tool calls)
                    head["logprobs"] = _logprobs(job.take_logprobs())
                yield [_line({**head, "done": True, "done_reason": done_reason(piece), **timings.stats(job, fin)})]
            case ApiError():
                yield [_line(error_body(piece))]


# ---------------------------------------------------------------------------
# errors


def error_body(exc: ApiError) -> dict[str, Any]:
    """Ollama's `{"error": "..."}`, with memvisor's code and figures as extra keys."""
    return {"error": exc.message, **exc.tagged()}


def error_response(exc: ApiError) -> Response:
    return Response(_encoder.encode(error_body(exc)), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


# ---------------------------------------------------------------------------
# handlers (bound by app.py)


async def handle_chat(request: Request, sup: Supervisor, metrics: Metrics, body: bytes, started: float) -> Response:
    req = decode_body(body, OllamaChatRequest)
    work = chat_generate(req)
    images.within_body(len(body), work.gen, sup.config.supervisor)
    return await _run(request, sup, metrics, req, work, started, chat=True, empty=not req.messages)


async def handle_generate(request: Request, sup: Supervisor, metrics: Metrics, body: bytes,
                          started: float) -> Response:
    req = decode_body(body, OllamaGenerateRequest)
    gen = generate_generate(req)
    images.within_body(len(body), gen.gen, sup.config.supervisor)
    if req.suffix:
        model = sup.model_config(resolve(sup, req.model))
        await require_fim(model.id, model.path)
    return await _run(request, sup, metrics, req, gen, started, chat=False,
                      empty=not req.prompt and not req.system and not req.suffix)

