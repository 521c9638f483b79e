"""A draft model: a small model of the same vocabulary that guesses a request's next tokens.

Why: prompt lookup (worker/speculate.py `NgramDrafter`) guesses only what the
text already holds; a small model of the same family guesses free text too,
at the cost of its own small passes. A `[[models]]` entry names it with
`draft = "<model id>"`; the worker loads it beside the model, in the same
process, so its weights count in the worker's usage (U1) as the model's do,
and admission counts them in the model's estimate (A2, supervisor/models/catalog.py).
Under pressure it is the first thing the worker lets go (`Engine.drop_draft`):
guessing is a speed-up, never a reason to stop someone's model.

Each request that guesses keeps the draft's own KV of its tokens (`DraftState`),
caught up on the tokens the model emitted since its last guess (all of the
prompt, the first time, in chunks) and rewound after each check to the tokens
the model kept. Its guesses are the draft's greedy choices; the model checks
them as it checks any guess, so the reply is the model's own greedy reply
whatever the draft says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, make_prompt_cache

CATCH_UP_CHUNK = 512  # tokens of one catch-up pass (the first one is the whole prompt)


class DraftState:
    """One request's KV in the draft model, and how many of its tokens it holds."""

    __slots__ = ("cache", "tokens")

    def __init__(self, cache: list[KVCache]) -> None:
        self.cache = cache
        self.tokens = 0


class DraftModel:
    """The draft model of a worker's model (see module doc)."""

    def __init__(self, model, name: str = "") -> None:
        self.model = model
        self.name = name

    def state(self) -> DraftState:
        return DraftState(make_prompt_cache(self.model))

    def propose(self, state: DraftState, context: Sequence[int], k: int) -> list[int]:
        """The draft's `k` greedy tokens after `context` (the request's tokens, the one in flight
        last); its KV then holds `context` and all guesses but the last."""
        held = state.tokens
        if held >= len(context):  # it was ahead (a guess it fed was rejected): start that part again
            self.rewind(state, len(context) - 1)
            held = state.tokens
        pending = list(context[held:])
        with mx.stream(generation_stream):
            for start in range(0, len(pending) - 1, CATCH_UP_CHUNK):
                self.model(mx.array([pending[start:min(start + CATCH_UP_CHUNK, len(pending) - 1)]]),
                           cache=state.cache)
                mx.eval([c.state for c in state.cache])
            token = mx.array([pending[-1:]])
            guesses = []
            for _ in range(k):
                token = mx.argmax(self.model(token, cache=state.cache)[:, -1, :], axis=-1)[:, None]
                guesses.append(token)
            mx.eval(guesses)
        state.tokens = len(context) + k - 1
        return [cast(int, g.item()) for g in guesses]

    @staticmethod
    def rewind(state: DraftState, tokens: int) -> None:
        """Keep the draft's KV of the first `tokens` tokens only (after a check kept that many)."""
        drop = state.tokens - tokens
        if drop > 0:
            for layer in state.cache:
                layer.trim(drop)
            state.tokens = tokens


def same_vocabulary(model_tokenizer, draft_tokenizer) -> str | None:
    """Why the draft's token ids cannot stand for the model's, or None when they can."""
    probe = "The quick brown fox 1234 jumps over the lazy dog. \u00e9t\u00e9 \u4e2d\u6587"
    if len(model_tokenizer.vocab) != len(draft_tokenizer.vocab):
        return f"its vocabulary has {len(draft_tokenizer.vocab)} tokens, the model's {len(model_tokenizer.vocab)}"
    if model_tokenizer.encode(probe) != draft_tokenizer.encode(probe):
        return "its tokenizer splits text into other token ids than the model's"
    return None
