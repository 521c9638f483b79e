"""The sampling options every API takes, as the worker's `Generate` fields.

Why one module: OpenAI's chat, completions and Responses bodies, Anthropic's
`top_k` and Ollama's `options` spell the same few settings differently; each
front door reads its own spelling and hands the values here, so the bounds
and the mapping exist once. The worker honours every one of them per request
(worker/sampling.py), in batched decode too.

The extra fields (`top_k`, `min_p`, `repetition_penalty` and the context
sizes) are the ones mlx_lm's server and vLLM take beside OpenAI's own; an
OpenAI SDK sends them through `extra_body`. Each is bounded here so a bad
value is a 400 naming it before anything is queued.

`Logprobs` is what a reply reports: per generated token its text, its
log-probability and the most likely alternatives (`shared.protocol.
TokenLogprobs`), rendered in each API's own shape by the front doors.
"""

from __future__ import annotations

from typing import Any, Union

from shared import protocol as p
from shared.protocol import MAX_TOP_LOGPROBS
from supervisor.http.openai_types import (
    BodyError,
    ChoiceLogprobs,
    CompletionLogprobs,
    LogprobOut,
    SamplingFields,
    TopLogprobOut,
)

_GENERATE_FIELDS = ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
                    "repetition_context_size", "presence_context_size", "frequency_context_size")


def generate_fields(req: SamplingFields) -> dict[str, Any]:
    """The `Generate` keyword arguments for the fields a request set (the rest keep the defaults)."""
    out: dict[str, Any] = {name: getattr(req, name) for name in _GENERATE_FIELDS if getattr(req, name) is not None}
    if req.logit_bias:
        out["logit_bias"] = dict(req.logit_bias)
    return out


def chat_logprobs(logprobs: Union[bool, int, None], top_logprobs: Union[int, None]) -> dict[str, Any]:
    """Chat's `logprobs: true` with `top_logprobs: N` (0-20); N without logprobs is a 400, as on OpenAI."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BodyError("logprobs: true or false in chat completions (top_logprobs gives the count)",
                        param="logprobs")
    top = _top(top_logprobs, "top_logprobs")
    if top and not logprobs:
        raise BodyError("top_logprobs: needs logprobs: true", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top} if logprobs else {}


def completion_logprobs(logprobs: Union[bool, int, None]) -> dict[str, Any]:
    """Completions' `logprobs: N`: the chosen token's logprob and the N most likely (0-20)."""
    if logprobs is None:
        return {}
    if isinstance(logprobs, bool):
        raise BodyError(f"logprobs: a number of alternatives from 0 to {MAX_TOP_LOGPROBS} in completions",
                        param="logprobs")
    return {"logprobs": True, "top_logprobs": _top(logprobs, "logprobs")}


def _top(value: Union[int, None], where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BodyError(f"{where}: from 0 to {MAX_TOP_LOGPROBS}, got {value!r}", param=where)
    return value


# ---------------------------------------------------------------------------
# what a reply reports


def _bytes(text: str) -> list[int]:
    # the token's text as the worker decoded it alone: a token that is part of a
    # multi-byte character reads as U+FFFD, and so do its bytes
    return list(text.encode("utf-8"))


def logprob_out(item: p.TokenLogprobs) -> LogprobOut:
    """One token in the shape chat, Responses and Ollama share: token, logprob, bytes, top_logprobs."""
    return LogprobOut(token=item.token, logprob=item.logprob, bytes=_bytes(item.token),
                      top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=_bytes(t.token))
                                    for t in item.top])


def chat_choice_logprobs(items: list[p.TokenLogprobs]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[logprob_out(item) for item in items])


def echo_logprobs(echoed: p.Echoed) -> CompletionLogprobs:
    """An echoed prompt's columns: every prompt token, the first with null (it has no context)."""
    after = completion_choice_logprobs(echoed.logprobs, len(echoed.tokens[0]) if echoed.tokens else 0)
    return CompletionLogprobs(tokens=echoed.tokens, token_logprobs=[None, *after.token_logprobs],
                              top_logprobs=[None, *after.top_logprobs], text_offset=[0, *after.text_offset])


def join_logprobs(first: CompletionLogprobs | None, then: CompletionLogprobs) -> CompletionLogprobs:
    """The echoed prompt's columns followed by the reply's."""
    if first is None:
        return then
    return CompletionLogprobs(tokens=first.tokens + then.tokens, token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


def completion_choice_logprobs(items: list[p.TokenLogprobs], offset: int) -> CompletionLogprobs:
    """Legacy completions' columns; `offset` is where the first token starts in the reply's text.
    Alternatives with the same text keep the most likely (a JSON object has one key per text)."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    tops: list[dict[str, float] | None] = []
    for item in items:
        top: dict[str, float] = {}
        for t in item.top:
            top.setdefault(t.token, t.logprob)
        tops.append(top)
    return CompletionLogprobs(tokens=[item.token for item in items], token_logprobs=[item.logprob for item in items],
                              top_logprobs=tops, text_offset=offsets)
