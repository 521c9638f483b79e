"""One request inside the engine: its state, its KV and its output so far (issue 22: out of engine.py).

Everything the engine keeps per request lives in `Seq`; the engine's
scheduler moves it between its lines (queue, prefill line, prefill group,
decode batch).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import mlx.core as mx

from worker import prompt_cache as pc
from worker.constrain import Constraint
from worker.sampling import Sampler
from worker.stops import StopMatcher

LayerCaches = list[Any]  # one mlx_lm cache per layer (KVCache, rotating, ...): mlx_lm types it List[Any] too
INVALID_REQUEST = "invalid_request"
CONTEXT_EXCEEDED = "context_length_exceeded"  # issue 16
ENGINE_ERROR = "engine_error"


class EngineError(ValueError):
    """A request or model the engine cannot take; `code` goes on the wire."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Detokenizer(Protocol):
    """What the engine uses of mlx_lm's streaming detokenizer (its classes are untyped)."""

    @property
    def last_segment(self) -> str: ...

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...



class Seq:
    """One request's state; slots keep per-token attribute access cheap."""

    __slots__ = (
        "id", "prompt", "max_tokens", "sample", "stopper", "state", "cache", "pos",
        "y", "detok", "generated", "retried", "deadline", "warned_soft", "constraint", "hit", "cached", "out",
    )

    def __init__(self, request_id: str, prompt: list[int], max_tokens: int, sampler: Sampler,
                 stopper: StopMatcher | None, constraint: Constraint | None = None):
        self.id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sample = sampler
        self.stopper = stopper
        self.state = "preflight"   # preflight | waiting | prefill | decoding
        self.cache: LayerCaches | None = None  # own KV while prefilling or decoding alone (not in a batch)
        self.pos = 0               # prompt tokens already in the KV cache
        self.y: mx.array | None = None  # next token (lazy / in flight); a batch row's is the batch's
        self.detok: Detokenizer | None = None  # from the first output token on
        self.generated = 0
        self.retried = False
        self.deadline = 0.0
        self.warned_soft = False
        self.constraint: Constraint | None = constraint  # issue 13: grammar of the output
        self.hit: pc.Hit | None = None  # the prompt-cache entry it will reuse (pinned, H3)
        self.cached = 0            # prompt tokens taken from the prompt cache (H1)
        self.out: list[int] = []   # generated token ids (the cache key after the prompt)

    def kv(self) -> LayerCaches:
        """The sequence's own KV, which it has from its prefill until it joins a batch or ends."""
        assert self.cache is not None, f"request {self.id} has no KV cache ({self.state})"
        return self.cache

    def token(self) -> mx.array:
        """The token in flight, which a sequence decoding outside a batch always has."""
        assert self.y is not None, f"request {self.id} has no token in flight ({self.state})"
        return self.y

    def token_id(self) -> int:
        """The token in flight read as an id (this waits for it); MLX types item() as int | float | complex."""
        return cast(int, self.token().item())
