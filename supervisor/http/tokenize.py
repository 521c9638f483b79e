"""`POST /tokenize` and `POST /detokenize`, as llama.cpp's server has them.

Why: clients count tokens before they send (to fit a context, to budget a
prompt), and llama.cpp's clients and its own test suite use these two routes.
Only the worker holds the tokenizer, so each request becomes one `Tokenize` /
`Detokenize` command that the model's worker answers between two engine steps
(`Supervisor.tokens`; the model is loaded on demand, under the guard, like a
generation).

- `/tokenize`: `content` (the text), `add_special` (default false: no BOS),
  `parse_special` (default true: special-token text becomes those tokens),
  `with_pieces` (each token as `{"id", "piece"}`; the piece is its text, or its
  byte values when it holds only part of a UTF-8 character) ->
  `{"tokens": [...]}`. memvisor also takes `messages` (and `tools`) in the chat
  completion shape instead of `content`: the tokens of that chat's prompt
  through the model's template, what a chat completion's `prompt_tokens` counts.
- `/detokenize`: `tokens` -> `{"content": "..."}`.
- `model` names the model; it may be left out when the server has exactly one.

Keyed like `/v1` and in OpenAI's error shape, as llama.cpp answers errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta, Struct
from starlette.responses import Response

from shared import protocol as p
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http.errors import from_failed, from_serve_error
from supervisor.http.openai import chat_generate
from supervisor.http.openai_types import BodyError, ChatMessageIn, ChatRequest, ToolDef, decode_body

_encoder = msgspec.json.Encoder()


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: Union[str, None] = None
    content: Union[str, None] = None
    add_special: Union[bool, None] = None  # None: false (no BOS), as llama.cpp
    parse_special: Union[bool, None] = None  # None: true
    with_pieces: bool = False
    # memvisor's addition: a chat's prompt through the model's template
    messages: Union[list[ChatMessageIn], None] = None
    tools: Union[list[ToolDef], None] = None


TokenId = Annotated[int, Meta(ge=0, lt=2**31)]  # llama.cpp's are int32; larger ones would not cross the wire


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[TokenId]
    model: Union[str, None] = None


def model_named(sup: Supervisor, name: str | None) -> str:
    """The model a request names, or the only one this server has."""
    if name is None:
        models = sup.config.models
        if len(models) != 1:
            raise BodyError(f"model: required (this server has {len(models)} models; name one)", param="model")
        return models[0].id
    try:
        return sup.model_config(name).id
    except ServeError as exc:
        raise from_serve_error(exc) from None


def tokenize_command(req: TokenizeRequest) -> p.Tokenize:
    rid = ""  # the supervisor gives it its id
    if req.messages is None:
        if req.content is None:
            raise BodyError("content: required (the text to tokenize), or messages for a chat's prompt",
                            param="content")
        if req.tools is not None:
            raise BodyError("tools: only with messages (the chat template renders them)", param="tools")
        return p.Tokenize(request_id=rid, text=req.content, add_special=req.add_special is True,
                          parse_special=req.parse_special is not False, with_pieces=req.with_pieces)
    if req.content is not None:
        raise BodyError("content: give content or messages, not both", param="content")
    for name in ("add_special", "parse_special"):  # the template decides where special tokens go
        if getattr(req, name) is not None:
            raise BodyError(f"{name}: applies to content, not to messages (the chat template places the "
                            "special tokens)", param=name)
    chat = ChatRequest(model=req.model or "", messages=req.messages, tools=req.tools)
    gen = chat_generate(chat).gen
    return p.Tokenize(request_id=rid, messages=gen.messages, tools=gen.tools, with_pieces=req.with_pieces)


def _piece(raw: bytes) -> Union[str, list[int]]:
    """llama.cpp's piece: the text, or the byte values of a token that is not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def _ask(sup: Supervisor, model: str, cmd: p.Tokenize | p.Detokenize) -> p.Tokenized | p.Detokenized:
    try:
        reply = await sup.tokens(model, cmd)
    except ServeError as exc:
        raise from_serve_error(exc) from None
    if isinstance(reply, p.Failed):
        raise from_failed(reply)
    return reply


async def tokenize(sup: Supervisor, body: bytes) -> Response:
    req = decode_body(body, TokenizeRequest)
    cmd = tokenize_command(req)
    reply = await _ask(sup, model_named(sup, req.model), cmd)
    assert isinstance(reply, p.Tokenized)  # the worker answers a Tokenize with Tokenized or Failed
    tokens: list[Any] = list(reply.tokens)
    if req.with_pieces:
        tokens = [{"id": t, "piece": _piece(raw)} for t, raw in zip(reply.tokens, reply.pieces)]
    return Response(_encoder.encode({"tokens": tokens}), media_type="application/json")


async def detokenize(sup: Supervisor, body: bytes) -> Response:
    req = decode_body(body, DetokenizeRequest)
    cmd = p.Detokenize(request_id="", tokens=req.tokens)
    reply = await _ask(sup, model_named(sup, req.model), cmd)
    assert isinstance(reply, p.Detokenized)
    return Response(_encoder.encode({"content": reply.text}), media_type="application/json")
