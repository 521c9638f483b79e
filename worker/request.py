"""One request inside the engine: its state, its KV and its output so far.

Everything the engine keeps per request lives in `Seq`, and everything that
changes a request's state is the table below, in the manner of h11's
`_state.py` (and shared/states.py for workers): the states, the events that
move them, one `transition()` that refuses an illegal move loudly. Follow one
request:

    queued --admit--> preflight (G1) --start--> prefill --first_token--> decoding
    preflight --need_memory--> waiting --retry--> preflight   (G1 asked the supervisor)
    prefill --need_memory--> held --retry--> prefill          (G2: not even the floor chunk fit)
    preflight --group--> grouped --first_token--> decoding    (prefilled together)
    grouped --split--> prefill                                (a group step did not fit: alone)
    any state but ended --end--> ended                        (Finished or Failed, exactly once)

The scheduler's lines (worker/scheduler.py) hold the states: the queue `queued`; the prefill line
`preflight`, `waiting`, `prefill` and `held`; the prefill group `grouped`; the
decode list (and the batch) `decoding`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, cast, get_args

import mlx.core as mx

from shared.protocol import SHARED_PARTITION
from shared.state_table import state_machine
from shared.vocab import FailureCode
from worker import prompt_cache as pc
from worker.constrain import Constraint
from worker.sampling import Sampler
from worker.speculate import Speculation
from worker.stops import StopMatcher

RequestState = Literal["queued", "preflight", "waiting", "prefill", "held", "grouped", "decoding", "ended"]
RequestEvent = Literal["admit", "need_memory", "retry", "start", "group", "split", "first_token", "end"]

TRANSITIONS: dict[RequestState, dict[RequestEvent, RequestState]] = {
    "queued": {"admit": "preflight", "end": "ended"},
    "preflight": {"need_memory": "waiting", "start": "prefill", "group": "grouped", "end": "ended"},
    "waiting": {"retry": "preflight", "end": "ended"},
    "prefill": {"need_memory": "held", "first_token": "decoding", "end": "ended"},
    "held": {"retry": "prefill", "end": "ended"},
    "grouped": {"split": "prefill", "first_token": "decoding", "end": "ended"},
    "decoding": {"end": "ended"},
    "ended": {},  # a second ending would be a second terminal event: a bug, said loudly
}


transition = state_machine("request", TRANSITIONS, get_args(RequestState))

# Waiting for the supervisor's answer to a request for room: G1 before the prefill, G2 inside it.
WAITING_FOR_ROOM: tuple[RequestState, ...] = ("waiting", "held")

LayerCaches = list[Any]  # one mlx_lm cache per layer (KVCache, rotating, ...): mlx_lm types it List[Any] too
INVALID_REQUEST: FailureCode = "invalid_request"
CONTEXT_EXCEEDED: FailureCode = "context_length_exceeded"
ENGINE_ERROR: FailureCode = "engine_error"


class EngineError(ValueError):
    """A request or model the engine cannot take; `code` goes on the wire."""

    def __init__(self, code: FailureCode, message: str):
        super().__init__(message)
        self.code: FailureCode = code
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
        "y", "detok", "generated", "retried", "floor_retried", "deadline", "warned_soft", "constraint", "hit", "cached", "out",
        "resuming", "cached_disk", "partition", "spec", "media",
    )

    def __init__(self, request_id: str, prompt: list[int], max_tokens: int, sampler: Sampler,
                 stopper: StopMatcher | None, constraint: Constraint | None = None,
                 partition: str = SHARED_PARTITION, spec: Speculation | None = None):
        self.id = request_id
        self.partition = partition  # the prompt-cache partition it reads and fills (H7 as proposed)
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sample = sampler
        self.stopper = stopper
        self.state: RequestState = "queued"  # changed only by move() (the table above)
        self.cache: LayerCaches | None = None  # own KV while prefilling or decoding alone (not in a batch)
        self.pos = 0               # prompt tokens already in the KV cache
        self.y: mx.array | None = None  # next token (lazy / in flight); a batch row's is the batch's
        self.detok: Detokenizer | None = None  # from the first output token on
        self.generated = 0
        self.retried = False       # G1 asked the supervisor for room (once per request)
        self.floor_retried = False  # G2 asked for room for its floor chunk (once per request)
        self.deadline = 0.0
        self.warned_soft = False
        self.constraint: Constraint | None = constraint  # grammar of the output
        self.hit: pc.Hit | None = None  # the prompt-cache entry it will reuse (pinned, H3)
        self.cached = 0            # prompt tokens taken from the prompt cache (H1)
        self.cached_disk = 0       # ... of which the disk tier read for this request (H5 as proposed)
        self.out: list[int] = []   # generated token ids (the cache key after the prompt)
        self.resuming = False      # y is its last prompt token, fed by a decode step (a whole-prompt hit)
        self.spec = spec           # its guessing (worker/speculate.py), when it may guess
        self.media: Any = None     # an image request's worker.vision.Media (its prompt is then the cache key)

    def move(self, event: RequestEvent) -> None:
        """The one way a request changes state (IllegalMove when the table does not allow it)."""
        self.state = transition(self.state, event)

    def retry_after_room(self) -> None:
        """The supervisor answered a request for room, or the wait ran out: G1 (`waiting`) or
        G2 (`held`) tries again, and does not ask a second time."""
        if self.state == "waiting":
            self.retried = True
        else:
            self.floor_retried = True
        self.move("retry")

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
