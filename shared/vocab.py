"""The closed vocabularies of the wire and the status: every word a field may hold.

Why here, as `Literal`s: these words are a contract with subscribers, routers
and dashboards, so a new one is a decision, not a typo. mypy refuses a word
that is not in its vocabulary (and, with strict equality, a comparison with
one that can never match), and msgspec refuses it at the edge, as it refuses
any other malformed field. The strings are the wire's: renaming one breaks
every client that reads it.

The tuples at the end give a vocabulary's words in order (the ledger stores
tiers and bindings by their index), and `parse(word, WORDS)` turns a str from
outside into a member, or None.
"""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

# -- the guard's pressure and what it is measured against ---------------------------------

# P1: the pressure level of a pool, and of the group (the worse of host and device, D4).
PressureLevel = Literal["ok", "soft", "hard"]

# D4: the two pools the guard watches (unified memory has only the host's).
PoolName = Literal["host", "device"]

# T1-T4: the tiers a guard runs on. A tier named in a config or a request is a
# plain str until T2 normalises it; what the guard reports is always one of these.
Tier = Literal["safe", "balanced", "aggressive", "custom"]

# C6: the host ceiling's component that sets it; "" when the guard is off (no ceiling).
# The order is the ledger's encoding of a worker's limits: append, never reorder.
HostBinding = Literal["", "static", "dynamic", "gpu_cap"]
# What a worker's limits are bound by: a host component, or "device" where its prefill
# guard holds a discrete device's pool (SPEC D). The ledger stores it by its index in
# this order: append, never reorder.
LimitBinding = Literal[HostBinding, "device"]
# D3: the device ceiling's component that sets it; "" when the guard is off.
DeviceBinding = Literal["", "device_static", "device_others"]
# A refusal names the binding of the pool that refused (A3, D5).
Binding = Literal[HostBinding, DeviceBinding]

# What a worker's ledger slot says it is doing (shared/ledger.py): the live worker states a
# worker itself knows (shared.states.WorkerState), and "empty" for a slot never written. The
# ledger stores a phase by its index in this order: append, never reorder.
WorkerPhase = Literal["empty", "starting", "loading", "ready", "busy", "draining", "spare"]

# Why a worker sent a sample now: its steady rate, a watermark it crossed (P9's wake-up),
# or a ShrinkCache it just obeyed (H3).
SampleReason = Literal["tick", "watermark", "shrink"]

# How a worker's prefill turn shares its token budget among the prompts prefilling
# (worker/scheduler.py): the fewest tokens left first, or equal shares.
PrefillOrder = Literal["shortest", "round_robin"]

# -- a model's load (SPEC W3, W6) ----------------------------------------------------------

# The phases of one load, in the order they happen: waiting for admission (the one-load lock,
# evictions, its files read), a fresh process started (`spawn`: Python up to the worker's
# entry; `hello`: MLX and the engine imported) or a spare handed the model (`spare`), the
# model built with its weights not yet read (`build`), the weights read (`read`), its
# tokenizer (`tokenizer`), a device's first-use costs (`warm_up`), and from the load's end
# to the first token of the request that asked for it (`first_token`). A load in progress
# says which one it is in.
LoadPhase = Literal["admit", "spawn", "hello", "spare", "build", "read", "tokenizer", "warm_up", "first_token"]

# -- events (SPEC S2) ----------------------------------------------------------------------

# What a worker may report as an event of its own. The supervisor's lifecycle
# kinds (crash, exit ...) drive respawns and evictions, so a report must not be
# able to pose as one: anything else is refused at decoding.
WorkerEventKind = Literal["drill", "wired_limit"]

# Why a stop of a worker was asked for (supervisor.workers.process.Leaving). A pinned model
# whose load the guard aborted (P6 step 4), or that was killed as wedged, comes back
# as after a crash; `spare`: a spare worker stopped to make room or under pressure (W2).
StopCause = Literal["request", "evict", "ttl", "unload", "load_abort", "wedged", "shutdown", "spare"]
# Why a worker is on its way out: `marked` (P6.3, or a load that failed) takes nothing new
# and waits to be stopped once idle; the rest say why its stop began.
LeaveCause = Literal["marked", StopCause]

# Every kind of `GuardEvent` the supervisor publishes on the `event` topic.
GuardEventKind = Literal[
    WorkerEventKind,
    # a worker's life
    "spawn", "loaded", "load_failed", "exit", "crash", "wedged", "respawn", "unload", "import",
    # a model that cannot be served, and its retries (restart intensity)
    "refused", "failed", "retry",
    # the guard's decisions carried out, and its settings
    "level", "admission", "warning", "reclaim", "shrink_cache", "abort", "abort_load", "mark_for_unload", "evict",
    "ttl", "guard",
    # the config re-read (SIGHUP, `reload`)
    "reload", "reload_refused", "model_added", "model_changed", "model_removed",
    # the supervisor's own loop was late (a stall the watchdog saw)
    "stall",
    # what a stopping worker wrote to the prompt cache's disk tier, and what its deadline cost (H5, proposed)
    "disk_cache",
    # wired memory a worker's exit did not give back within 5 s (M3, macOS): counted as lost
    "wired_stranded",
    # W1, W2: a spare worker started, handed a model, stopped to make room or under pressure
    "spare",
    # W6: a load in progress, its phase and the bytes read; W3: a finished load's phases
    "load_progress", "load_phases",
    # swaps (SPEC W): models that evict each other (W5), weights read ahead into the page cache (W4)
    "thrash", "prefetch",
]

# -- how requests end ------------------------------------------------------------------------

# Why a worker's request finished normally (`Finished.finish_reason`).
FinishReason = Literal["stop", "length"]
# What the front door says: a reply the model gave as tool calls ends with "tool_calls" (OpenAI's word).
ReplyFinishReason = Literal[FinishReason, "tool_calls"]

# Why a request ended without finishing: the code of a worker's `Failed`, and the
# code an `AbortRequests` asks the worker to fail its requests with.
FailureCode = Literal[
    # the request itself (a 400 for the client to fix)
    "invalid_request", "invalid_constraint", "context_length_exceeded", "prefill_memory_exceeded", "wrong_model_kind",
    "fim_unsupported",
    # images (docs/vision.md): one that is not a usable image or is over a cap, or any image for a text model
    "invalid_image", "model_lacks_vision",
    # the guard or the supervisor took it away (a 503 worth a retry)
    "aborted", "memory_pressure", "model_unloading", "worker_exited", "client_disconnected",
    # the worker could not run it (our bug, or MLX's: a 500)
    "engine_error", "load_failed",
]

# A3 / D5: why a model load was refused (a 507).
RefusalCode = Literal["model_too_large", "insufficient_memory"]

# What the supervisor says when it refuses on someone's behalf (supervisor.doors.refusals.ServeError,
# the control socket's `ControlError`, readiness).
ServeCode = Literal[
    "internal_error", "spawn_failed", "too_many_workers", "overloaded", "model_unreadable", "model_at_capacity",
    "model_not_found", "model_not_loaded", "model_loading", "model_failed", "admission_paused",
    "worker_unresponsive", "worker_timeout", "drills_disabled", "reload_unsupported", "reload_busy", "reload_timeout",
    "invalid_config", "invalid_guard_settings", "bad_reply", "shutting_down",
]

# What the front door says for a status no raise site names, and its own refusals.
HttpCode = Literal[
    "invalid_api_key", "missing_api_key", "forbidden", "origin_not_allowed", "not_found", "unknown_endpoint",
    "method_not_allowed", "request_timeout", "conflict", "request_too_large", "unsupported_media_type",
    "misdirected_request", "unprocessable", "not_implemented", "unavailable", "timeout", "invalid_header",
    "invalid_topic", "too_many_connections",
    "error",  # a status no row of the table names
]

# Every `code` an error answer carries, on any door (HTTP bodies, the control socket).
ErrorCode = Literal[FailureCode, RefusalCode, ServeCode, HttpCode]


# -- frames refused at the edge ---------------------------------------------------------------

# Why a decoder refused a frame (`shared.protocol.Malformed.cause`): a fixed set, so
# the counters and the log lines of refusals stay bounded whatever a peer sends.
MalformedCause = Literal["too_large", "undecodable", "wrong_version", "invalid_message"]


# -- helpers -------------------------------------------------------------------------------

Word = TypeVar("Word", bound=str)


def parse(word: str, vocabulary: tuple[Word, ...]) -> Word | None:
    """`word` as a member of `vocabulary` (a tuple of its words), or None when it is not one."""
    for member in vocabulary:
        if member == word:
            return member
    return None


# Each vocabulary's words in the order its Literal lists them (nested ones flattened).
PRESSURE_LEVELS: tuple[PressureLevel, ...] = get_args(PressureLevel)
TIERS: tuple[Tier, ...] = get_args(Tier)
HOST_BINDINGS: tuple[HostBinding, ...] = get_args(HostBinding)
LIMIT_BINDINGS: tuple[LimitBinding, ...] = get_args(LimitBinding)
WORKER_PHASES: tuple[WorkerPhase, ...] = get_args(WorkerPhase)
GUARD_EVENT_KINDS: tuple[GuardEventKind, ...] = get_args(GuardEventKind)
LOAD_PHASES: tuple[LoadPhase, ...] = get_args(LoadPhase)
ERROR_CODES: tuple[ErrorCode, ...] = get_args(ErrorCode)
