"""The checks a request passes before the engine queues it, each a clear `EngineError`
(invalid_request, context_length_exceeded) that becomes the request's one `Failed`.

Apart from worker/engine.py because they read nothing the engine changes: a request's
id, prompt, token budget and sampling settings against the model's vocabulary and
context window, and the wire `Generate`'s prompt turned into tokens. The engine
supplies what they compare against (the ids in use, the context length).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from shared.protocol import Generate
from worker import prompts
from worker.request import CONTEXT_EXCEEDED, INVALID_REQUEST, EngineError
from worker.sampling import Settings, check


def model_vocab(model: Any) -> int | None:
    """The model's vocabulary size, when its args name it (prompt ids and logit_bias are checked against it)."""
    return getattr(getattr(model, "args", None), "vocab_size", None)


def check_prompt(request_id: str, prompt_tokens: list[int], max_tokens: int, *, in_use: Container[str],
                 context_length: int | None, vocab: int | None) -> None:
    if not request_id:
        raise EngineError(INVALID_REQUEST, "request id must not be empty")
    if request_id in in_use:
        raise EngineError(INVALID_REQUEST, f"request id {request_id!r} is already in use")
    if not prompt_tokens:
        raise EngineError(INVALID_REQUEST, "prompt is empty")
    # the prompt and the reply must fit the model's context window
    if context_length and len(prompt_tokens) + max_tokens > context_length:
        raise EngineError(CONTEXT_EXCEEDED, f"the prompt ({len(prompt_tokens)} tokens) plus max_tokens "
                                            f"({max_tokens}) exceeds the model's context of "
                                            f"{context_length} tokens; shorten the prompt or lower max_tokens")
    if vocab is not None and not all(0 <= t < vocab for t in prompt_tokens):
        raise EngineError(INVALID_REQUEST, f"prompt has token ids outside [0, {vocab})")


def check_sampling(settings: Settings, vocab: int | None) -> None:
    """The sampling settings' own checks (worker/sampling.py), as an EngineError."""
    problem = check(settings, vocab)
    if problem is not None:
        raise EngineError(INVALID_REQUEST, problem)


def prompt_of(tokenizer: Any, cmd: Generate) -> list[int]:
    """The request's prompt tokens: chat turns through the template, a completion prompt (with
    its FIM suffix), or token ids as given."""
    if sum(x is not None for x in (cmd.messages, cmd.prompt, cmd.prompt_tokens)) != 1:
        raise EngineError(INVALID_REQUEST, "give exactly one of messages or prompt (its text or prompt_tokens)")
    if cmd.messages is not None:
        return prompts.encode_chat(tokenizer, cmd.messages, cmd.tools)
    if cmd.prompt_tokens is not None:
        if cmd.suffix is not None:
            raise EngineError(INVALID_REQUEST, "suffix: fill in the middle takes a text prompt, not token ids")
        return list(cmd.prompt_tokens)
    assert cmd.prompt is not None  # one of the three
    if cmd.suffix is not None:  # fill in the middle
        return prompts.encode_fim(tokenizer, cmd.prompt, cmd.suffix)
    return prompts.encode_prompt(tokenizer, cmd.prompt)
