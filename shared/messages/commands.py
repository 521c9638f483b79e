"""Supervisor -> worker: the start spec a worker is spawned with, and `CommandMsg` on
the command socket (ROUTER -> DEALER): limits, reclaims, aborts, requests, drain.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from shared.limits import Limits
from shared.messages.envelope import Msg
from shared.vocab import FailureCode, PrefillOrder

__all__ = [
    "WorkerSpec", "DISK_CACHE_AUTO", "Command", "SetLimits", "Reclaim", "ShrinkCache", "AbortRequests",
    "ImageInput", "MessagePart", "ChatMessage", "JsonObject", "JsonSchema", "ToolFunction", "ToolCallConstraint",
    "LarkGrammar", "ConstraintSpec", "Partition", "SHARED_PARTITION", "Generate", "Tokenize", "Detokenize", "Embed",
    "MemoryAnswer", "Drain", "Ping", "Drill", "DrillStop", "TakeModel", "CommandMsg"
]


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
    chunk_seconds: float = 0.25  # the time one prefill turn aims at (its heartbeat cannot interrupt one)
    prefill_order: PrefillOrder = "shortest"  # how a prefill turn's budget is shared (worker/scheduler.py)
    draft_path: str = ""  # the draft model's folder (speculative decoding, worker/draft.py); "" = none
    allow_drills: bool = False
    # The prompt cache's disk tier (H5 as proposed) and shrink before drop (H6).
    # Bytes every model's entries on disk may hold together: DISK_CACHE_AUTO sizes it to the
    # disk's free space, 0 turns the tier off (nothing written, nothing read).
    disk_cache_max: int = 0
    # H5: seconds a worker with nothing to run may spend writing the entries its memory tier
    # drops (a shrink, a smaller cap) before dropping them; a stop's grace comes in its Drain
    disk_cache_grace: float = 0.0
    cache_quantize_bits: int = 0  # H6: 8 or 4 quantizes unused entries at soft pressure; 0 = off

    @property
    def spare(self) -> bool:
        """SPEC W1: started with no model (MLX and the engine imported), it waits for a `TakeModel`."""
        return not self.model_id


DISK_CACHE_AUTO = -1  # WorkerSpec.disk_cache_max: "auto", sized by the worker from the disk's free space


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


class ImageInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a request (images in: docs/vision.md).

    The front door checks every image before its `Generate` is sent
    (supervisor/http/images.py: decoded with Pillow, format, pixels and bytes
    within the caps) and fills `digest`, `width`, `height` and `format`; a
    worker refuses an image without a digest. `digest` (sha256 of `data`) is
    what the prompt cache keys the image's tokens on, never a URL. `url` and
    `param` live only inside the front door: an http(s) URL still to fetch and
    the body field the image came from (errors name it)."""

    data: bytes = b""
    digest: str = ""
    width: int = 0
    height: int = 0
    format: str = ""  # Pillow's name: PNG, JPEG, WEBP, GIF
    url: str = ""
    param: str = ""


class MessagePart(msgspec.Struct, frozen=True, kw_only=True):
    """One part of a turn whose content mixes text and images, in order: `text`, or
    `image` (an index into `Generate.images`)."""

    text: Union[str, None] = None
    image: Union[int, None] = None


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    role: str
    content: str
    # a turn with images: its parts in order (`content` is then their text, joined); None for text
    parts: Union[list[MessagePart], None] = None
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


# Whose prompt-cache entries a generation may see and leaves behind (SPEC H7 as proposed):
# with API keys, a keyed hash of the caller's key the supervisor derives (never the key); without
# keys, SHARED_PARTITION for everyone. A closed shape: a frame with any other text is Malformed.
Partition = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{32})?$")]
SHARED_PARTITION = ""


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
    speculative: bool = True  # False: never guess ahead (speculative decoding), even alone
    # fill in the middle: `prompt` is the text before, this the text after
    # (the worker builds the prompt from its tokenizer's FIM tokens; prompt only)
    suffix: Union[str, None] = None
    # A completion prompt already in the model's token ids (lm-evaluation-harness sends
    # them), taken as it is: no BOS added. Exactly one of messages, prompt, prompt_tokens.
    prompt_tokens: Union[list[int], None] = None
    # OpenAI completions' echo: the worker answers `Echoed` (the prompt's text and, with
    # `logprobs`, each prompt token's logprob) before the reply; with echo, max_tokens may be 0
    # (the prompt scored, nothing generated)
    echo: bool = False
    partition: Partition = SHARED_PARTITION  # the prompt cache's partition (SPEC H7 as proposed)
    # the images the messages' parts point at, in order (a vision model's; docs/vision.md)
    images: list[ImageInput] = []


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


class TakeModel(Command, tag="take_model", kw_only=True):
    """SPEC W1, the hand-off: a spare worker becomes the worker of `spec`'s model.

    `spec` is the whole start spec a fresh worker of that model would have been
    spawned with; its worker id, slot, ledger and endpoints must be the spare's
    own (the process keeps its identity), else the spare refuses it with
    `LoadFailed`. The spare then loads as any worker does: `Loaded` or
    `LoadFailed`. A worker that is not a spare refuses it the same way.
    """

    spec: WorkerSpec


CommandMsg = Union[SetLimits, Reclaim, ShrinkCache, AbortRequests, Generate, MemoryAnswer, Drain, Ping, Drill, DrillStop,
                   Embed, Tokenize, Detokenize, TakeModel]
