"""The wire protocol between the supervisor, its workers and outside clients.

Every message is a msgspec Struct, tagged by a `type` field and carrying the
protocol version `v`. There is one union per direction and socket, so each
socket has exactly one decoder and a peer can never slip a message of the
wrong direction in:

  worker DEALER  -> supervisor ROUTER   WorkerReply   (hello, acks, token streams)
  supervisor ROUTER -> worker DEALER    Command       (limits, reclaim, abort, generate ...)
  worker PUSH    -> supervisor PULL     WorkerReport  (samples, events)
  supervisor PUB -> any SUB             Published     (topic frame + message frame)
  CLI DEALER     -> supervisor ROUTER   ControlRequest / ControlReply

Frames are msgpack. `decode_*` never raises on bad bytes: it returns a
`Malformed` explaining what was wrong (including a peer that speaks another
protocol version), so a socket loop can count it, log it once and go on.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from shared.limits import Limits
from shared.memory import MemoryReading
from shared.vocab import (
    DeviceBinding,
    ErrorCode,
    FailureCode,
    FinishReason,
    GuardEventKind,
    HostBinding,
    LimitBinding,
    MalformedCause,
    PressureLevel,
    SampleReason,
    Tier,
    WorkerEventKind,
)

PROTOCOL_VERSION = 1

# Largest frame any socket accepts; zmq enforces it with ZMQ_MAXMSGSIZE, so an
# oversized frame is dropped by the transport before it costs memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024

TOPICS = ("ceiling", "pressure", "sample", "event", "status")

# OpenAI's bound on the alternatives a token's logprobs list; every door and the worker take the same.
MAX_TOP_LOGPROBS = 20

class Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=False):
    """Base of every wire message: the protocol version rides in each one."""

    v: int = PROTOCOL_VERSION


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker process is started with (passed encoded, not pickled)."""

    worker_id: str
    model_id: str
    model_path: str
    slot: int
    ledger_path: str
    commands: str  # supervisor ROUTER endpoint
    reports: str  # supervisor PULL endpoint
    supervisor_pid: int
    sample_interval: float = 0.25
    heartbeat_timeout: float = 5.0
    max_concurrency: int = 4
    chunk_seconds: float = 1.0  # the time one prefill chunk aims at (its heartbeat cannot interrupt one)
    allow_drills: bool = False
    # The prompt cache's disk tier (H5 as proposed) and shrink before drop (H6).
    # Bytes every model's entries on disk may hold together: DISK_CACHE_AUTO sizes it to the
    # disk's free space, 0 turns the tier off (nothing written, nothing read).
    disk_cache_max: int = 0
    # H5: seconds a worker with nothing to run may spend writing the entries its memory tier
    # drops (a shrink, a smaller cap) before dropping them; a stop's grace comes in its Drain
    disk_cache_grace: float = 0.0
    cache_quantize_bits: int = 0  # H6: 8 or 4 quantizes unused entries at soft pressure; 0 = off


DISK_CACHE_AUTO = -1  # WorkerSpec.disk_cache_max: "auto", sized by the worker from the disk's free space


# --------------------------------------------------------------------------
# worker -> supervisor, on the command socket (DEALER -> ROUTER)


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


class Loaded(Msg, tag="loaded", kw_only=True):
    weight_bytes: int
    seconds: float
    usage: int = 0


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


class Finished(Msg, tag="finished", kw_only=True):
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # H1: prompt tokens reused from the worker's prompt cache
    cached_disk_tokens: int = 0  # H5 (proposed): the part of cached_tokens this request read from disk
    stop_sequence: str = ""  # the stop string that ended it ("" = EOS, length, grammar)


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
                    NeedMemory, Prompted, Embedded, Tokenized, Detokenized]
TokensReply = Union[Tokenized, Detokenized, Failed]  # what answers a Tokenize / Detokenize


# --------------------------------------------------------------------------
# supervisor -> worker, on the command socket (ROUTER -> DEALER)


class Command(Msg, kw_only=True):
    cmd: int = 0


class SetLimits(Command, tag="set_limits", kw_only=True):
    limits: Limits


class Reclaim(Command, tag="reclaim", kw_only=True):
    """Return the MLX pool to the OS at the next step boundary (P4, P6.6)."""

    reason: str = ""
    idle_only: bool = False


class ShrinkCache(Command, tag="shrink_cache", kw_only=True):
    """H3/P5: drop LRU prompt-cache entries no request uses until at most
    `target_bytes` remain, return the pool, and report a sample at once.
    Answered with `Reclaimed` (bytes the pool gave back)."""

    target_bytes: int
    reason: str = ""


class AbortRequests(Command, tag="abort", kw_only=True):
    """Abort these requests (all when `request_ids` is None); each gets a terminal Failed."""

    request_ids: Union[list[str], None] = None
    reason: str = ""
    code: FailureCode = "aborted"


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    role: str
    content: str
    # tool calling: an assistant turn's calls, as JSON text of
    # `[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`
    # (the shape HF chat templates read), and the call a `tool` turn answers.
    tool_calls: Union[str, None] = None
    tool_call_id: Union[str, None] = None


# --- constrained decoding -----------------------------------------------
# What the worker's output must match. Schemas travel as JSON text: a JSON
# Schema is open-ended, so it is checked by the worker's grammar compiler (a
# bad one fails its request with `invalid_request`), not by this decoder.
# Frozen with tuples, so a spec is hashable: the worker caches compiled
# grammars by it.


class _ConstraintBase(msgspec.Struct, tag_field="kind", frozen=True, kw_only=True):
    """Base of the constraint union (tag field `kind`: `type` marks whole messages)."""


class JsonObject(_ConstraintBase, tag="json_object", frozen=True, kw_only=True):
    """response_format json_object: any one JSON object."""


class JsonSchema(_ConstraintBase, tag="json_schema", frozen=True, kw_only=True):
    """response_format json_schema: JSON valid against `schema` (JSON text).

    strict: every keyword must be enforced, an unsupported one is an error;
    not strict: unsupported keywords are ignored (best effort).
    """

    schema: str
    strict: bool = True
    name: str = ""


class ToolFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    parameters: str = '{"type": "object"}'  # JSON Schema text of the arguments
    strict: bool = True


class ToolCallConstraint(_ConstraintBase, tag="tool_call", frozen=True, kw_only=True):
    """tool_choice required (any of `functions`) or named (`name` only).

    The output is a JSON array of calls, `[{"name": ..., "arguments": {...}}]`:
    one call unless `parallel` (then one or more; named is always one).
    """

    functions: tuple[ToolFunction, ...]
    mode: Literal["required", "named"] = "required"
    name: str = ""
    parallel: bool = False


class LarkGrammar(_ConstraintBase, tag="lark", frozen=True, kw_only=True):
    """A context-free grammar in llguidance's Lark dialect."""

    lark: str


ConstraintSpec = Union[JsonObject, JsonSchema, ToolCallConstraint, LarkGrammar]
# --- end constrained decoding ----------------------------------------------


class Generate(Command, tag="generate", kw_only=True):
    request_id: str
    messages: Union[list[ChatMessage], None] = None
    prompt: Union[str, None] = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: Union[int, None] = None
    constraint: Union[ConstraintSpec, None] = None  # constrained decoding
    # JSON text of the tool list `[{"type": "function", "function": {...}}]`,
    # handed to the model's chat template as `tools` (how the model learns of them)
    tools: Union[str, None] = None
    # the rest of the sampling settings (worker/sampling.py); each default leaves
    # the logits as they are. Penalties look back over the last `*_context_size` tokens
    # (prompt and reply), as mlx_lm's server does; 0 switches a penalty off.
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative (sign-aware), mlx_lm's
    repetition_context_size: int = 20
    presence_penalty: float = 0.0  # additive, OpenAI's
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # additive per occurrence, OpenAI's
    frequency_context_size: int = 20
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    logprobs: bool = False  # each token's TokenOut carries its TokenLogprobs
    top_logprobs: int = 0  # ... with this many most likely alternatives (at most MAX_TOP_LOGPROBS)
    # fill in the middle: `prompt` is the text before, this the text after
    # (the worker builds the prompt from its tokenizer's FIM tokens; prompt only)
    suffix: Union[str, None] = None


# -- the worker's tokenizer on request ------------------------------------------------
# Why commands: only the worker holds the tokenizer and the chat template (the
# supervisor never imports the tokenizer stack). The worker answers at once, between
# two engine steps, with `Tokenized` / `Detokenized`, or a `Failed` of the same
# request_id when the input cannot be used; no generation, no memory of its own.


class Tokenize(Command, tag="tokenize", kw_only=True):
    """Text (`text`) or chat turns through the model's template (`messages`, `tools`)
    -> token ids, as llama.cpp's /tokenize: `add_special` adds the BOS (and what else
    the tokenizer adds), `parse_special` reads special-token text as those tokens."""

    request_id: str
    text: Union[str, None] = None
    messages: Union[list[ChatMessage], None] = None
    tools: Union[str, None] = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class Detokenize(Command, tag="detokenize", kw_only=True):
    request_id: str
    tokens: list[int]


class Embed(Command, tag="embed", kw_only=True):
    """Embed each input with the worker's embedding model; answered by one
    `Embedded` or one `Failed`. Exactly one of `texts` and `token_ids` is given.

    `truncate`: an input longer than the model's limit is cut to it (else the
    request fails with `context_length_exceeded`). `dimensions`: Matryoshka
    truncation to that length (renormalised when the model normalises); the
    front door has checked that the model allows it.
    """

    request_id: str
    texts: Union[list[str], None] = None
    token_ids: Union[list[list[int]], None] = None  # the model's own token ids, taken as they are
    truncate: bool = False
    dimensions: Union[int, None] = None


class MemoryAnswer(Command, tag="memory_answer", kw_only=True):
    """Reply to NeedMemory: eviction done (retry once) or nothing to evict."""

    request_id: str
    evicted: bool


class Drain(Command, tag="drain", kw_only=True):
    """Finish what runs, take nothing new, then exit.

    `save_seconds` (H5 as proposed): once drained, the worker may
    spend this long writing its prompt cache to the disk tier before it exits;
    what is not written by then is dropped and counted. The supervisor's stop
    escalation waits exactly this much longer before SIGTERM, no more. 0 (the
    default, and every stop of a worker whose disk tier is off): write nothing.
    """

    reason: str = ""
    save_seconds: float = 0.0


class Ping(Command, tag="ping", kw_only=True):
    seq: int = 0


class Drill(Command, tag="drill", kw_only=True):
    """Fire drill: grow real MLX allocations at `rate` bytes/s up to `to` bytes."""

    rate: int
    to: int


class DrillStop(Command, tag="drill_stop", kw_only=True):
    pass


CommandMsg = Union[SetLimits, Reclaim, ShrinkCache, AbortRequests, Generate, MemoryAnswer, Drain, Ping, Drill, DrillStop,
                   Embed, Tokenize, Detokenize]


# --------------------------------------------------------------------------
# worker -> supervisor, on the report socket (PUSH -> PULL)


class Sample(Msg, tag="sample", kw_only=True):
    """One memory reading of a worker (SPEC U1, H2) with its load; also published as `sample`.

    `memory` is the very struct the worker wrote into its ledger slot.
    """

    worker_id: str
    model_id: str
    pid: int
    seq: int
    t: float  # time.monotonic() in the worker: shared clock on Linux and macOS
    memory: MemoryReading
    running: int = 0
    queued: int = 0
    tokens: int = 0
    why: SampleReason = "tick"


class WorkerEvent(Msg, tag="worker_event", kw_only=True):
    worker_id: str
    kind: WorkerEventKind
    message: str


# -- liveness from the worker's heartbeat thread ----------------------------
class Alive(Msg, tag="alive", kw_only=True):
    """Pushed by a worker's heartbeat thread (its own socket) every fraction
    of the heartbeat timeout, also while the step loop is inside one long
    engine step (MLX computes with the GIL released). The supervisor decides:
    a worker inside a step is alive until `step_timeout`; a worker whose loop
    is stuck outside a step, or that sends nothing (SIGSTOP), is wedged."""

    worker_id: str
    pid: int
    step_seconds: float  # how long the current engine step has run; 0 between steps
    loop_seconds: float  # since the step loop last passed a step boundary
    steps: int           # step boundaries passed so far (progress)
    tokens: int = 0      # tokens generated so far (progress)


# -- the prompt cache's tiers (H5, H6 as proposed, docs/spec-proposal-h5-h6.md) ------------
class DiskCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """One model's prompt-cache disk tier as its worker sees it, and what this worker did with it.

    `entries`/`bytes` are this model's files, `all_bytes` every model's (what
    `budget` bounds). The counters are this worker's since it started: read
    when a request's prefix came from disk, written and dropped (not written
    because the stop's deadline came first, H5) at its stop, evicted to stay
    within the budget. `quantized_*` are the memory tier's shrink before drop (H6).
    """

    folder: str = ""
    entries: int = 0
    bytes: int = 0
    all_bytes: int = 0
    budget: int = 0               # the budget in force; 0 = the tier is off
    read_entries: int = 0
    read_bytes: int = 0
    read_tokens: int = 0
    written_entries: int = 0
    written_bytes: int = 0
    dropped_entries: int = 0
    dropped_bytes: int = 0
    evicted_entries: int = 0
    evicted_bytes: int = 0
    save_seconds: float = 0.0     # the last stop's write: how long it took ...
    save_deadline: float = 0.0    # ... of how long it was given (Drain.save_seconds)
    quantized_entries: int = 0    # H6: entries quantized in memory ...
    quantized_bytes: int = 0      # ... and the bytes that returned


class CacheReport(Msg, tag="cache_report", kw_only=True):
    """Sent when the tiers' figures change: at start (the folder indexed), after a read
    from disk or a quantization, and once after the stop's write (`final`), just
    before the process exits; the supervisor keeps the last one per model."""

    worker_id: str
    model_id: str
    pid: int
    stats: DiskCacheStats
    final: bool = False


WorkerReport = Union[Sample, WorkerEvent, Alive, CacheReport]
# -- end of the prompt cache's tiers --------------------------------------------


# --------------------------------------------------------------------------
# supervisor -> anyone, on PUB (first frame: topic)


class DevicePool(msgspec.Struct, frozen=True, kw_only=True):
    """SPEC D6: a discrete device's pool (D2-D4), shown beside the host's.

    One struct for one fact, carried by `CeilingMsg.device`, `PressureMsg.device`
    and the status (`GuardStatus.device`). Those fields are None where there is
    no discrete device (unified memory, CPU only): every surface then shows the
    host pool alone, as before.
    """

    name: str = ""                # the device's name ("" when unknown)
    total: int                    # device memory
    free: Union[int, None]        # free on the device now; None: no reading (dynamic = static)
    usage: int                    # the group's device bytes (D1): the pool's usage
    others: int                   # held by other processes on the GPU (0 without a free reading)
    reserve: int                  # D2
    reserve_exceeds_total: bool   # static floored to 1 byte: every load is refused
    static: int                   # D3 device static
    dynamic: int                  # D3 device dynamic
    ceiling: int                  # D3; 0 = guard off (no limit)
    binding: DeviceBinding        # "" when the guard is off
    remedy: str                   # what a person can do about the binding ("" if none)
    soft_threshold: float
    hard_threshold: float
    soft_bytes: int               # C11 on the device
    hard_bytes: int
    level: PressureLevel          # D4: this pool's level
    emergency: bool               # P2 on the device
    utilization: float            # usage / ceiling, 0 when there is no ceiling


class CeilingMsg(Msg, tag="ceiling", kw_only=True):
    t: float
    enabled: bool
    tier: Tier
    ceiling: int
    static: int
    dynamic: int
    gpu_cap: int
    binding: HostBinding
    soft_bytes: int
    hard_bytes: int
    reserve: int
    hot_cache_max: int = 0       # H2: the group's prompt-cache budget (watch shows the sum against it)
    hot_cache_reserved: int = 0  # C12
    device: Union[DevicePool, None] = None  # D6: the discrete device's pool (None: no device)


class PressureMsg(Msg, tag="pressure", kw_only=True):
    t: float
    level: PressureLevel         # the group's: the worse of host and device (D4)
    usage: int
    soft_bytes: int
    hard_bytes: int
    ceiling: int
    utilization: float
    admission_paused: bool
    interval: float
    device: Union[DevicePool, None] = None  # D6: the device pool's usage and level (None: no device)


class GuardEvent(Msg, tag="event", kw_only=True):
    """SPEC S2: every level change, eviction, abort, reclaim, kill, respawn,
    refused load ... with the reason people read."""

    t: float
    kind: GuardEventKind
    reason: str
    worker_id: str = ""
    model_id: str = ""
    usage: int = 0
    ceiling: int = 0


class StatusMsg(Msg, tag="status", kw_only=True):
    t: float
    # SPEC S1 as JSON (supervisor.policy.status.ServerStatus; the struct lives with
    # the status builder, which this package must not import).
    status: bytes


Published = Union[CeilingMsg, PressureMsg, Sample, GuardEvent, StatusMsg]

TOPIC_OF = {CeilingMsg: "ceiling", PressureMsg: "pressure", Sample: "sample", GuardEvent: "event", StatusMsg: "status"}


# --------------------------------------------------------------------------
# CLI -> supervisor, on the control socket


class StatusRequest(Msg, tag="status_request", kw_only=True):
    pass


class LoadRequest(Msg, tag="load_request", kw_only=True):
    model: str
    # "Will it fit?": answer with a FitReport (JSON in ControlOk.data), spawn nothing.
    dry_run: bool = False
    context: int = 0  # tokens of KV cache to count on top of the weights (dry run)


class UnloadRequest(Msg, tag="unload_request", kw_only=True):
    model: str


class DrillRequest(Msg, tag="drill_request", kw_only=True):
    model: str
    rate: int
    to: int
    stop: bool = False


class GuardUpdate(Msg, tag="guard_update", kw_only=True):
    """SPEC T6: change tier, custom ceiling(s) or the on/off switch at runtime."""

    tier: Union[str, None] = None
    custom_ceiling: Union[int, None] = None
    enabled: Union[bool, None] = None
    custom_device_ceiling: Union[int, None] = None  # D2: the device ceiling on the custom tier (0 = unset)


class ReloadRequest(Msg, tag="reload_request", kw_only=True):
    """Re-read the config and rescan the models folders; running models stay up."""


ControlRequest = Union[StatusRequest, LoadRequest, UnloadRequest, DrillRequest, GuardUpdate, ReloadRequest]


class ControlOk(Msg, tag="ok", kw_only=True):
    detail: str = ""
    data: bytes = b""  # JSON, e.g. supervisor.policy.status.ServerStatus for a StatusRequest


class ControlError(Msg, tag="error", kw_only=True):
    code: ErrorCode
    message: str
    http_status: int = 400


ControlReply = Union[ControlOk, ControlError]


# --------------------------------------------------------------------------
# decoding at the edge


class Malformed(msgspec.Struct, frozen=True):
    """A frame that could not be taken: `cause` to count it by (never text the
    sender chose), `reason` one short line for the log."""

    cause: MalformedCause
    reason: str

    @property
    def wrong_version(self) -> bool:
        return self.cause == "wrong_version"


class _Peek(msgspec.Struct):
    v: int = -1
    type: str = ""


_peek = msgspec.msgpack.Decoder(_Peek)


class Codec:
    """One encoder and one decoder for one socket direction.

    `encode` returns fresh bytes on every call (never an `encode_into` buffer
    that a zero-copy send might still hold).
    """

    def __init__(self, union: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)
        self.union = union

    def encode(self, msg: Msg) -> bytes:
        return self._enc.encode(msg)

    def decode(self, frame: bytes) -> Any:
        """The message, or `Malformed` (never raises)."""
        if len(frame) > MAX_FRAME_BYTES:
            return Malformed("too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            msg = self._dec.decode(frame)
        except msgspec.DecodeError as exc:
            return _explain(frame, exc)
        if msg.v != PROTOCOL_VERSION:
            return Malformed("wrong_version", f"peer speaks protocol v{msg.v}, this side v{PROTOCOL_VERSION}")
        return msg


def _explain(frame: bytes, exc: Exception) -> Malformed:
    try:
        peek = _peek.decode(frame)
    except (msgspec.DecodeError, TypeError, ValueError):
        return Malformed("undecodable", f"undecodable frame ({len(frame)} bytes): {exc}")
    if peek.v not in (-1, PROTOCOL_VERSION):
        return Malformed("wrong_version", f"peer speaks protocol v{peek.v}, this side v{PROTOCOL_VERSION}")
    return Malformed("invalid_message", f"invalid {peek.type or 'untyped'} message: {exc}")


def all_message_types() -> dict[str, object]:
    """Every union on the wire, by name (for `python -m supervisor schema`)."""
    return {
        "WorkerReply": WorkerReply,
        "Command": CommandMsg,
        "WorkerReport": WorkerReport,
        "Published": Published,
        "ControlRequest": ControlRequest,
        "ControlReply": ControlReply,
    }
