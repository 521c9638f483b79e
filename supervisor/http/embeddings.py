"""Embeddings on the same port: OpenAI's `POST /v1/embeddings` (also
`/embeddings`) and Ollama's `POST /api/embed` and older `POST /api/embeddings`.

Why one module for the three: they are one request (inputs in, one vector
each out) spelled three ways. The path of a request:

  body -> inputs (texts or token ids), `dimensions`, truncation
  -> the model's embedding facts (Supervisor.embedding_spec: its folder's
     sentence-transformers files, read off the loop once; None: a chat model,
     a 400 in the API's own shape)
  -> shared.protocol.Embed through Supervisor.embed: the same on-demand load,
     admission gate and worker as a generation (SPEC A, P3), so an embedding
     model's memory, eviction, pinning and TTL are a chat model's
  -> one `Embedded` (float32 vectors in one buffer) or one `Failed`.

OpenAI's shape: `input` a string, a list of strings, a list of token ids or a
list of such lists (the model's own ids, taken as they are: no [CLS]/[SEP]
added); `encoding_format` "float" or "base64" (little-endian float32, which
the openai SDK asks for by default and decodes); `dimensions` where the model
was trained for Matryoshka truncation (its config's `matryoshka_dimensions`),
else a 400 naming it; `usage.prompt_tokens`. An input over the model's limit
is a 400 (`context_length_exceeded`). Ollama's shape: `input` a string or a
list of strings, checked by the same `inputs` as OpenAI's (an empty string in a
list is a 400 on both; no input, `""` or `[]` is Ollama's empty request, which
only loads the model), `truncate` (default true: an over-long input is cut to the
limit), `embeddings` with `prompt_eval_count` and the durations in
nanoseconds; `/api/embeddings` takes one `prompt` and answers one `embedding`.
A request holds at most `EmbeddingSpec.input_cap()` inputs (2,048, fewer for
wide vectors: a reply is one frame), a 400 past it.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from typing import Any, Literal, Union

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from shared.embedding import WRONG_MODEL_KIND, EmbeddingSpec
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http import ollama, ollama_options, routing
from supervisor.http.errors import ApiError, from_failed, from_serve_error
from supervisor.http.job import race_client
from supervisor.http.keepalive import keep_alive_seconds
from supervisor.http.metrics import Metrics
from supervisor.http.openai_types import BodyError, KeepAlive, decode_body

_encoder = msgspec.json.Encoder()


# ---------------------------------------------------------------------------
# requests


class EmbeddingRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's embeddings request (every field of the SDK's EmbeddingCreateParams)."""

    model: str
    input: Any  # a string, strings, token ids, or lists of token ids: checked by `inputs`
    encoding_format: Union[Literal["float", "base64"], None] = None
    dimensions: Union[int, None] = None
    user: Union[str, None] = None  # abuse tracking: changes nothing here
    keep_alive: KeepAlive = None  # the per-request idle timer (P10), as on every other route
    ttl: Union[int, None] = None


class OllamaEmbedRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: Union[str, list[str], None] = None
    truncate: Union[bool, None] = None  # Ollama's default: true
    options: Union[dict[str, Any], None] = None
    keep_alive: KeepAlive = None
    dimensions: Union[int, None] = None


class OllamaEmbeddingsRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """The older `/api/embeddings`: one prompt, one vector."""

    model: str
    prompt: Union[str, None] = None
    options: Union[dict[str, Any], None] = None
    keep_alive: KeepAlive = None


class Inputs(Struct, kw_only=True):
    texts: Union[list[str], None] = None
    token_ids: Union[list[list[int]], None] = None

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or [])


def inputs(raw: Any) -> Inputs:
    """OpenAI's `input`, each of its four forms, or a 400 naming `input`."""
    if isinstance(raw, str):
        if not raw:
            raise BodyError("input: must not be an empty string", param="input")
        return Inputs(texts=[raw])
    if not isinstance(raw, list) or not raw:
        raise BodyError("input: a string, a list of strings, a list of token ids or a list of such lists, "
                        "and not empty", param="input")
    if all(isinstance(x, str) for x in raw):
        if not all(raw):
            raise BodyError("input: strings must not be empty", param="input")
        return Inputs(texts=list(raw))
    if all(_token(x) for x in raw):
        return Inputs(token_ids=[list(raw)])
    if all(isinstance(x, list) and x and all(_token(t) for t in x) for x in raw):
        return Inputs(token_ids=[list(x) for x in raw])
    raise BodyError("input: a list must hold only strings, only token ids (whole numbers from 0), or only "
                    "non-empty lists of token ids", param="input")


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def check_request(spec: EmbeddingSpec | None, model: str, given: Inputs, dimensions: int | None) -> None:
    """What the model's facts decide before anything is sent: its kind, `dimensions`, the cap."""
    if spec is None:
        raise ApiError(400, f"model {model!r} generates text; it is not an embedding model (embeddings need a "
                            "sentence-transformers model folder)", code=WRONG_MODEL_KIND, param="model")
    if dimensions is not None:
        if isinstance(dimensions, bool) or dimensions < 1:
            raise BodyError("dimensions: a whole number of at least 1", param="dimensions")
        if not spec.allows_dimensions(dimensions):
            shorter = (f"it was trained to be cut to {', '.join(map(str, spec.matryoshka))}" if spec.matryoshka
                       else "its config names no Matryoshka dimensions, so its vectors cannot be cut shorter")
            raise BodyError(f"dimensions: {dimensions} is not available for {model!r}: its vectors have "
                            f"{spec.dims} values and {shorter}", param="dimensions")
    cap = spec.input_cap(dimensions)
    if len(given) > cap:
        raise BodyError(f"input: {len(given)} inputs in one request; at most {cap} for this model", param="input")


# ---------------------------------------------------------------------------
# one request, start to finish


class Outcome(Struct, kw_only=True):
    vectors: list[bytes]  # one little-endian float32 row per input
    token_counts: list[int]
    opened: float  # when the stream opened (the load and the queue were behind it)


async def run(request: Request, sup: Supervisor, metrics: Metrics, model: str, given: Inputs, *,
              dimensions: int | None, truncate: bool, keep: float | None) -> Outcome:
    """Route one embedding request to the model's worker and wait for its vectors,
    aborting it in the worker when the client goes away."""
    try:
        spec = await race_client(sup.embedding_spec(model), request.receive)
        check_request(spec, model, given, dimensions)
        cmd = p.Embed(request_id="", texts=given.texts, token_ids=given.token_ids,
                      truncate=truncate, dimensions=dimensions)
        served = routing.current()  # a router's X-Memvisor-Max-Wait in, X-Memvisor-Worker out
        stream = await race_client(sup.embed(model, cmd, max_wait=served.max_wait()), request.receive)
        served.worker = stream.worker_id
    except ServeError as exc:
        raise from_serve_error(exc) from None
    if keep is not None:  # loaded now: its idle timer is this request's
        sup.keep_alive(model, keep)
    opened = time.monotonic()
    try:
        msg = await race_client(stream.queue.get(), request.receive)
    except BaseException:
        sup.cancel(stream, "client disconnected")
        metrics.cancelled(model)
        raise
    if isinstance(msg, p.Failed):
        metrics.failed(model, msg.code)
        raise from_failed(msg)
    if not isinstance(msg, p.Embedded) or not _well_formed(msg, len(given)):
        metrics.failed(model, "malformed_reply")
        raise ApiError(500, "the worker's reply to an embedding request was malformed", code="internal_error")
    metrics.finished(model, 0)
    width = msg.dimensions * 4
    rows = [msg.vectors[i * width:(i + 1) * width] for i in range(len(msg.token_counts))]
    return Outcome(vectors=rows, token_counts=msg.token_counts, opened=opened)


def _well_formed(msg: p.Embedded, count: int) -> bool:
    return len(msg.token_counts) == count and msg.dimensions > 0 and len(msg.vectors) == count * msg.dimensions * 4


def floats(row: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(row)
    if sys.byteorder == "big":  # the wire's rows are little-endian
        values.byteswap()
    return values.tolist()


# ---------------------------------------------------------------------------
# OpenAI


class EmbeddingOut(Struct, kw_only=True):
    index: int
    embedding: Union[list[float], str]
    object: str = "embedding"


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct, kw_only=True):
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


async def handle_openai(request: Request, sup: Supervisor, metrics: Metrics, body: bytes) -> Response:
    req = decode_body(body, EmbeddingRequest)
    given = inputs(req.input)
    keep = keep_alive_seconds(req.keep_alive, req.ttl)
    try:
        model = sup.model_config(req.model).id
    except ServeError as exc:
        raise from_serve_error(exc) from None
    out = await run(request, sup, metrics, model, given, dimensions=req.dimensions, truncate=False, keep=keep)
    as_base64 = req.encoding_format == "base64"
    data = [EmbeddingOut(index=i, embedding=base64.b64encode(row).decode() if as_base64 else floats(row))
            for i, row in enumerate(out.vectors)]
    used = sum(out.token_counts)
    return _json(EmbeddingList(data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=used,
                                                                                total_tokens=used)))


# ---------------------------------------------------------------------------
# Ollama


def _options(options: dict[str, Any] | None) -> None:
    """Ollama's options, checked as on /api/chat; none changes a vector (sampling and
    placement), so the valid ones are accepted and the rest is a 400 naming it."""
    ollama_options.sampling(options)


async def handle_embed(request: Request, sup: Supervisor, metrics: Metrics, body: bytes, started: float) -> Response:
    req = decode_body(body, OllamaEmbedRequest)
    _options(req.options)
    empty = not req.input  # no input, "" or []: Ollama's empty request, which only loads the model
    given = Inputs(texts=[]) if empty else inputs(req.input)  # OpenAI's checks: [""] is a 400 on both
    model = ollama.resolve(sup, req.model)
    keep = keep_alive_seconds(req.keep_alive, None)
    if empty:
        await _load_only(request, sup, model, keep)
        return _json({"model": req.model, "embeddings": []})
    out = await run(request, sup, metrics, model, given, dimensions=req.dimensions,
                    truncate=req.truncate is not False, keep=keep)
    end, ns = time.monotonic(), 1_000_000_000
    return _json({"model": req.model, "embeddings": [floats(row) for row in out.vectors],
                  "total_duration": int((end - started) * ns),
                  "load_duration": int(max(0.0, out.opened - started) * ns),
                  "prompt_eval_count": sum(out.token_counts)})


async def handle_embeddings(request: Request, sup: Supervisor, metrics: Metrics, body: bytes) -> Response:
    req = decode_body(body, OllamaEmbeddingsRequest)
    _options(req.options)
    model = ollama.resolve(sup, req.model)
    keep = keep_alive_seconds(req.keep_alive, None)
    if not req.prompt:
        await _load_only(request, sup, model, keep)
        return _json({"embedding": []})
    out = await run(request, sup, metrics, model, Inputs(texts=[req.prompt]), dimensions=None, truncate=True,
                    keep=keep)
    return _json({"embedding": floats(out.vectors[0])})


async def _load_only(request: Request, sup: Supervisor, model: str, keep: float | None) -> None:
    """An empty Ollama request loads the model (a chat model is still refused: it has no vectors)."""
    try:
        spec = await race_client(sup.embedding_spec(model), request.receive)
        if spec is None:
            check_request(spec, model, Inputs(texts=[]), None)
        await race_client(sup.load(model, explicit=True), request.receive)
    except ServeError as exc:
        raise from_serve_error(exc) from None
    if keep is not None:
        sup.keep_alive(model, keep)


def _json(body: Any) -> Response:
    return Response(_encoder.encode(body), media_type="application/json")

