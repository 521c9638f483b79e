"""`POST /infill`, llama.cpp's fill-in-the-middle route, for the editor plugins built on it.

Why: llama.vim and llama.vscode complete code at the cursor through this
route, not through OpenAI's `suffix`. The text before the cursor is
`input_extra` (other files' text, as context), `input_prefix` and `prompt`
(the cursor's line so far), the text after it `input_suffix`; the worker
builds the model's own FIM prompt from them, exactly as for a completion
with a `suffix` (shared/fim.py). A model without FIM tokens is refused
before any load, naming `input_suffix`.

The reply is llama.cpp's completion shape: `{"content", "stop": true,
"stop_type", "tokens_predicted", "tokens_evaluated", ...}`, or with `stream`
an SSE event per piece of text (`{"content": "...", "stop": false}`) and the
same final object with empty content. Settings that only mean something to
llama.cpp's slots and timers (`samplers`, `cache_prompt`, `t_max_*_ms`,
`n_indent`, `response_fields`, `id_slot`) are accepted and ignored, so the
plugins work unchanged; any other unknown field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Literal, Union

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from supervisor.doors.api import Supervisor
from supervisor.http.errors import ApiError
from supervisor.http.job import End, Job, Text, open_stream
from supervisor.http.metrics import Metrics
from supervisor.http.modelfacts import require_fim
from supervisor.http.openai import checked_seed, stop_sequences
from supervisor.http.openai_types import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    BodyError,
    MaxTokens,
    MinP,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    decode_body,
)
from supervisor.http.tokenize import model_named
from supervisor.workers.streams import StreamReply

_encoder = msgspec.json.Encoder()
MAX_STOPS = 16  # llama.cpp sets no limit; OpenAI's 4 would refuse a plugin's list


class ExtraChunk(Struct, forbid_unknown_fields=True):
    """Another file's text, given as context before the prefix."""

    filename: str
    text: str


class InfillRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: Union[str, None] = None  # may be left out when the server has one model
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""  # the cursor's line so far: it follows the prefix
    n_predict: Union[int, None] = None  # -1 (llama.cpp: "until done"): the completions default here
    stream: bool = False
    temperature: Union[Temperature, None] = None
    top_k: Union[TopK, None] = None
    top_p: Union[TopP, None] = None
    min_p: Union[MinP, None] = None
    repeat_penalty: Union[RepetitionPenalty, None] = None
    presence_penalty: Union[Penalty, None] = None
    frequency_penalty: Union[Penalty, None] = None
    seed: Union[int, None] = None
    stop: list[str] = []
    # llama.cpp's own knobs, with no meaning here: accepted, ignored
    n_indent: Union[int, None] = None
    samplers: Union[list[str], str, None] = None
    cache_prompt: Union[bool, None] = None
    t_max_prompt_ms: Union[int, None] = None
    t_max_predict_ms: Union[int, None] = None
    response_fields: Union[list[str], None] = None
    id_slot: Union[int, None] = None


class InfillReply(Struct, kw_only=True):
    """llama.cpp's completion object, the fields a client reads."""

    content: str
    stop: bool
    model: str = ""
    tokens_predicted: int = 0
    tokens_evaluated: int = 0
    tokens_cached: int = 0
    stop_type: Literal["", "eos", "word", "limit"] = ""
    stopping_word: str = ""
    truncated: bool = False


def _max_tokens(n_predict: int | None) -> int:
    if n_predict is None or n_predict == -1:
        return DEFAULT_COMPLETION_MAX_TOKENS
    try:
        return msgspec.convert(n_predict, MaxTokens)
    except msgspec.ValidationError:
        raise BodyError(f"n_predict: -1 or from 1 to 1000000, got {n_predict}", param="n_predict") from None


def infill_generate(req: InfillRequest) -> p.Generate:
    """The request as the worker's FIM generation: context and prefix before the cursor, the suffix after."""
    before = "".join(chunk.text for chunk in req.input_extra) + req.input_prefix + req.prompt
    settings: dict[str, Any] = {name: value for name, value in (
        ("top_k", req.top_k), ("top_p", req.top_p), ("min_p", req.min_p), ("repetition_penalty", req.repeat_penalty),
        ("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty))
        if value is not None}
    return p.Generate(request_id="", prompt=before, suffix=req.input_suffix, max_tokens=_max_tokens(req.n_predict),
                      temperature=1.0 if req.temperature is None else req.temperature,
                      stop=stop_sequences(req.stop, MAX_STOPS), seed=checked_seed(req.seed), **settings)


def _final(model: str, end: End) -> InfillReply:
    fin = end.finished
    kind: Literal["eos", "word", "limit"] = ("limit" if fin.finish_reason == "length"
                                             else "word" if fin.stop_sequence else "eos")
    return InfillReply(content="", stop=True, model=model, tokens_predicted=fin.completion_tokens,
                       tokens_evaluated=fin.prompt_tokens, tokens_cached=fin.cached_tokens, stop_type=kind,
                       stopping_word=fin.stop_sequence)


async def _events(job: Job, first: StreamReply) -> AsyncIterator[list[bytes]]:
    async for piece in job.pieces(first):
        match piece:
            case Text(text=text):
                body = _encoder.encode(InfillReply(content=text, stop=False))
            case End():
                body = _encoder.encode(_final(job.model, piece))
            case ApiError():
                body = piece.body()
            case _:  # no tool plan on this route: no calls
                continue
        yield [b"data: " + body + b"\n\n"]


async def handle(request: Request, sup: Supervisor, metrics: Metrics, body: bytes, started: float) -> Response:
    req = decode_body(body, InfillRequest)
    gen = infill_generate(req)
    model_id = model_named(sup, req.model)
    await require_fim(model_id, sup.model_config(model_id).path, "input_suffix")
    stream = await open_stream(sup, model_id, gen, request.receive)
    job = Job(sup, metrics, model_id, gen, started, stream)
    if req.stream:
        return await job.streamed(request.receive, lambda first: _events(job, first))
    text, _calls, end = await job.collect(request.receive)
    reply = _final(model_id, end)
    reply.content = text
    return Response(_encoder.encode(reply), media_type="application/json")
