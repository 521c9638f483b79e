"""Worker -> supervisor on the command socket (DEALER -> ROUTER): `WorkerReply`.

The answers to commands and the request streams: hello and load, acks, tokens
(one `TokenBatch` per decode step), a request's ending, its memory asks.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from shared.messages.envelope import Msg
from shared.vocab import FailureCode, FinishReason, LimitBinding, LoadPhase

__all__ = [
    "Hello", "Loaded", "LoadFailed", "Ack", "Pong", "Reclaimed", "TopLogprob", "TokenLogprobs", "TokenOut",
    "TokenBatch", "coalesce", "Prompted", "PrefillProgress", "Echoed", "Finished", "Failed", "NeedMemory",
    "Embedded", "Tokenized", "Detokenized", "WorkerReply", "TokensReply"
]


class Hello(Msg, tag="hello", kw_only=True):
    """First message of a worker; the supervisor refuses another version."""

    worker_id: str
    model_id: str
    pid: int
    # mx.device_info() as the worker saw it (the supervisor never imports MLX).
    device_info: dict[str, Union[int, float, str]] = {}
    device: str = ""  # D1: where its arrays live, mx.default_device() ("Device(gpu, 0)")
    slot: int = -1
    blas: str = ""    # the BLAS its MLX computes with (worker.blas), "" from older workers
    # W1: a spare (no model) that now waits for a `TakeModel`; `model_id` is then ""
    spare: bool = False
    # W3: time.monotonic() when the process entered the worker's code (a shared clock on
    # Linux and macOS): spawn -> `started` is the process's start, `started` -> hello its imports
    started: float = 0.0


class Loaded(Msg, tag="loaded", kw_only=True):
    """The model is loaded. W3: `began` (time.monotonic()) is when the worker began
    this load (after its hello, or as it took the model as a spare), `phases` the
    seconds each of its own phases took (`read`, `build`, `tokenizer`, `warm_up`)."""

    weight_bytes: int
    seconds: float
    usage: int = 0
    began: float = 0.0
    phases: dict[LoadPhase, float] = {}


class LoadFailed(Msg, tag="load_failed", kw_only=True):
    error: str


class Ack(Msg, tag="ack", kw_only=True):
    """Reply to a command that has no richer answer; `cmd` echoes its id."""

    cmd: int
    ok: bool = True
    detail: str = ""


class Pong(Msg, tag="pong", kw_only=True):
    seq: int


class Reclaimed(Msg, tag="reclaimed", kw_only=True):
    cmd: int
    freed_bytes: int


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One of the most likely tokens at a position: its text and log-probability."""

    token: str
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A generated token's log-probability and the `top` alternatives, most likely first.

    Why the token's own text: `TokenOut.text` is what the detokenizer and the stop
    strings let out at this step, which need not be this token's piece; the APIs'
    logprobs are per token. Why arrays: a request that asks for them sends one per
    token, and field names would be most of its bytes.
    """

    token: str
    logprob: float
    top: list[TopLogprob] = []


class TokenOut(Msg, tag="token", kw_only=True):
    request_id: str
    text: str
    token_id: int = -1
    # only for a request that asked for logprobs; UNSET is left off the frame,
    # so a token of any other request costs not one byte more
    logprobs: Union[TokenLogprobs, msgspec.UnsetType] = msgspec.UNSET


# -- batched decode ----------------------------------------------------------------
class TokenBatch(Msg, tag="tokens", kw_only=True):
    """The tokens of one decode step for several requests, in one frame.

    Why columns: a batched worker emits one token per sequence per step; one
    frame (one send, one receive, one decode) for all of them instead of one
    each keeps the supervisor's CPU per token down. Row i is one `TokenOut`;
    `tokens()` gives them back. Lists of unequal length are malformed.
    """

    request_ids: list[str]
    texts: list[str]
    token_ids: list[int]
    # a column only when some row asked for logprobs (None in the rows that did not)
    logprobs: Union[list[Union[TokenLogprobs, None]], msgspec.UnsetType] = msgspec.UNSET

    def well_formed(self) -> bool:
        """Every column has one entry per row."""
        n = len(self.request_ids)
        return n == len(self.texts) == len(self.token_ids) and (
            self.logprobs is msgspec.UNSET or len(self.logprobs) == n)

    def tokens(self) -> list[TokenOut]:
        """The rows as `TokenOut`s (none when the columns disagree in length)."""
        if not self.well_formed():
            return []
        if self.logprobs is msgspec.UNSET:
            return [TokenOut(request_id=r, text=t, token_id=i)
                    for r, t, i in zip(self.request_ids, self.texts, self.token_ids)]
        return [TokenOut(request_id=r, text=t, token_id=i, logprobs=msgspec.UNSET if lp is None else lp)
                for r, t, i, lp in zip(self.request_ids, self.texts, self.token_ids, self.logprobs)]


def coalesce(events: list[Msg]) -> list[Msg]:
    """A step's events with its `TokenOut`s folded into one `TokenBatch`.

    The batch takes the place of the first token; a request's tokens keep
    their order and still come before its own terminal event, which always
    follows its last token in a step's events.
    """
    tokens = [ev for ev in events if type(ev) is TokenOut]
    if len(tokens) < 2:
        return events
    whole = TokenBatch(request_ids=[t.request_id for t in tokens], texts=[t.text for t in tokens],
                       token_ids=[t.token_id for t in tokens])
    if any(t.logprobs is not msgspec.UNSET for t in tokens):
        whole.logprobs = [None if t.logprobs is msgspec.UNSET else t.logprobs for t in tokens]
    batch: TokenBatch | None = whole
    out: list[Msg] = []
    for ev in events:
        if type(ev) is not TokenOut:
            out.append(ev)
        elif batch is not None:
            out.append(batch)
            batch = None
    return out


class Prompted(Msg, tag="prompted", kw_only=True):
    """A request's prompt is final: its length and what the prompt cache gave.

    Why: `Finished` says the same only at the end, but a front door may need the
    count at the start (Anthropic's streamed `message_start` carries `input_tokens`).
    The worker sends it once per request when its prefill starts (after the cache
    lookup, so `cached_tokens` is what `Finished` will report), always before the
    request's first token; a request refused before its prefill gets none.
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    cached_disk_tokens: int = 0  # H5 (proposed): the part of cached_tokens read from the disk tier


class PrefillProgress(Msg, tag="prefill_progress", kw_only=True):
    """A long prompt's prefill has run `done` of its `total` tokens.

    Why: a prompt of thousands of tokens can prefill for minutes before its first
    token, and a streamed reply then says nothing; a proxy in front cut one after
    600 s. Sent after each prefill chunk that leaves more to run (a prompt that fits
    one chunk sends none); the front door shows it to a streamed request's client
    while it waits (SSE comment lines)."""

    request_id: str
    done: int
    total: int


class Echoed(Msg, tag="echoed", kw_only=True):
    """The prompt of a `Generate` with `echo`, as the model read it, before its reply.

    `text`: the prompt's tokens decoded (a token-id prompt has no other text).
    With `logprobs`: `tokens`, each prompt token's own text, and `logprobs`, the
    log-probability of prompt tokens 2..n given the ones before (with the request's
    `top_logprobs` alternatives); the first token has none (OpenAI's null).
    Why its own message: lm-evaluation-harness's multiple-choice tasks score
    prompts this way (echo, logprobs, max_tokens 1 or 0)."""

    request_id: str
    text: str
    tokens: list[str] = []
    logprobs: list[TokenLogprobs] = []


class Finished(Msg, tag="finished", kw_only=True):
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # H1: prompt tokens reused from the worker's prompt cache
    cached_disk_tokens: int = 0  # H5 (proposed): the part of cached_tokens this request read from disk
    stop_sequence: str = ""  # the stop string that ended it ("" = EOS, length, grammar)
    # Speculative decoding (worker/speculate.py): guessed tokens the model checked, and those of
    # them it chose too (part of completion_tokens); OpenAI's accepted/rejected_prediction_tokens
    proposed_tokens: int = 0
    accepted_tokens: int = 0


class Failed(Msg, tag="failed", kw_only=True):
    """Terminal error of one request (SPEC G1: `prefill_memory_exceeded`)."""

    request_id: str
    code: FailureCode
    message: str
    estimated_bytes: int = 0
    limit_bytes: int = 0
    binding: LimitBinding = ""


class NeedMemory(Msg, tag="need_memory", kw_only=True):
    """SPEC G1: a prefill does not fit; ask the supervisor to evict idle models.

    `pool` says where the shortfall is: host RAM, or the discrete device's
    pool (SPEC D) when the worker's arrays live there; the victims' bytes in
    that pool are what covers it.
    """

    request_id: str
    need_bytes: int
    pool: Literal["host", "device"] = "host"


class Embedded(Msg, tag="embedded", kw_only=True):
    """The vectors of one `Embed`, its terminal reply.

    Why bytes: a request may embed thousands of inputs, and float32 in one
    buffer is a quarter of msgpack's floats and what OpenAI's base64 encoding
    sends as is. Row i of `count` rows is input i, `dimensions` float32 values,
    little-endian; the front door refuses requests whose vectors would not fit
    one frame (shared.embedding.EmbeddingSpec.input_cap).
    """

    request_id: str
    dimensions: int
    vectors: bytes
    token_counts: list[int]  # tokens of each input as embedded (after any truncation)


# -- the worker's tokenizer on request ------------------------------------------------
class Tokenized(Msg, tag="tokenized", kw_only=True):
    """The answer to `Tokenize`: the token ids and, when asked, each token's bytes (a
    token may hold part of a UTF-8 character, so bytes, not text)."""

    request_id: str
    tokens: list[int]
    pieces: list[bytes] = []


class Detokenized(Msg, tag="detokenized", kw_only=True):
    """The answer to `Detokenize`: the text of the tokens."""

    request_id: str
    text: str


WorkerReply = Union[Hello, Loaded, LoadFailed, Ack, Pong, Reclaimed, TokenOut, TokenBatch, Finished, Failed,
                    NeedMemory, Prompted, PrefillProgress, Echoed, Embedded, Tokenized, Detokenized]
TokensReply = Union[Tokenized, Detokenized, Failed]  # what answers a Tokenize / Detokenize
