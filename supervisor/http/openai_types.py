"""Request and response bodies of the OpenAI-compatible front door.

Bodies are decoded straight into these Structs by msgspec, so a wrong type is
caught at the edge with the field path in the message (`max_tokens: Expected
`int`, got `str``) and the handlers only ever see valid, typed values.

Nothing is silently ignored: an unknown field is a 400 naming it
(`forbid_unknown_fields`), and every field of the OpenAI SDK's request types
is declared here and either honoured, refused with a 400 naming it unless it
has its neutral value (`n > 1`, `logprobs`, `logit_bias`, `echo`, ...), or
accepted with no effect where that is truthful (see the comments: ids for
abuse tracking, caching hints, `store: false`). A client that asked for JSON
must never silently get prose. `tests/test_api_fields.py` walks the SDK's
TypedDicts to keep it so.

Public names (stable): ChatRequest, CompletionRequest, ChatMessageIn,
ContentPart, StreamOptions, Usage, ChatCompletion, ChatChunk,
TextCompletion, ModelCard, ModelList, ErrorBody, ErrorDetail,
GuardSettingsIn, BodyError, decode_body.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

import msgspec
from msgspec import Meta, Struct

from shared.vocab import ErrorCode, ReplyFinishReason
from supervisor.doors.views import LoadProgress
from supervisor.guard.readiness import Readiness
from supervisor.policy.status import ModelInfo

T = TypeVar("T")
C = TypeVar("C")  # the choice type of a completion

# OpenAI's own bounds; the worker gets nothing outside them.
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=1_000_000)]
Role = Literal["system", "developer", "user", "assistant", "tool"]

# Defaults when the client gives no limit. OpenAI's legacy completions default
# to 16 tokens; chat has no documented default, so we pick a bounded one
# rather than "until the context is full".
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4


class BodyError(ValueError):
    """A request body that cannot be used: HTTP 400 with `param` = the field path."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------
# requests


class ContentPart(Struct, kw_only=True):
    """One part of a multi-part message: text, or an image for a vision model (http/images.py).

    Lenient about the part's other keys: a part of another type is refused by type."""

    type: str
    text: Union[str, None] = None
    image_url: Any = None  # chat: {"url", "detail"}; Responses' input_image: the URL itself
    file_id: Any = None  # Responses' input_image: refused (no files API)
    detail: Any = None  # Responses' input_image: accepted, no effect (the processor sizes the image)


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    """One tool call, the same object both ways: an assistant turn's earlier call in
    the history, a reply's call, and (with its `index`) a streamed delta's call."""

    index: Union[int, msgspec.UnsetType] = msgspec.UNSET  # its place in a streamed delta's list
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessageIn(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Role
    content: Union[str, list[ContentPart], None] = None
    name: Union[str, None] = None  # a participant's name: templates do not render it
    tool_calls: Union[list[ToolCall], None] = None  # assistant turns
    tool_call_id: Union[str, None] = None  # role "tool": the call it answers
    refusal: Union[str, None] = None  # an earlier assistant refusal: history only
    function_call: Any = None  # deprecated; refused when set
    audio: Any = None  # refused when set


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    include_obfuscation: Union[bool, None] = None  # padding against side channels: nothing to pad here


StopField = Union[str, list[str], None]
# Ollama's keep_alive: seconds, or a duration ("5m", "1h30m", "0", "-1").
KeepAlive = Union[int, float, str, None]


# -- the sampling options (mapped to Generate by http/sampling_options.py) ------
MAX_LOGIT_BIAS = 1024  # entries; far past any real use, and keeps the worker's command frame small
WHOLE_CONTEXT = 1 << 30  # a look-back longer than any context (Ollama's repeat_last_n -1)

TopK = Annotated[int, Meta(ge=0)]  # 0: off
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's bounds for presence and frequency
ContextSize = Annotated[int, Meta(ge=0, le=WHOLE_CONTEXT)]  # 0: the penalty is off
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]  # OpenAI's bounds
LogitBias = Annotated[dict[Annotated[int, Meta(ge=0)], Bias], Meta(max_length=MAX_LOGIT_BIAS)]


class SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's penalties and bias, and the extra fields mlx_lm's server takes (`extra_body`
    in the SDK), on every OpenAI-style body. null leaves a setting neutral."""

    presence_penalty: Union[Penalty, None] = None
    frequency_penalty: Union[Penalty, None] = None
    logit_bias: Union[LogitBias, None] = None  # token id (a string key in JSON) -> bias
    top_k: Union[TopK, None] = None
    min_p: Union[MinP, None] = None
    repetition_penalty: Union[RepetitionPenalty, None] = None
    repetition_context_size: Union[ContextSize, None] = None
    presence_context_size: Union[ContextSize, None] = None
    frequency_context_size: Union[ContextSize, None] = None
# -- end of the sampling options ---------------------------------------------------------


class _Sampling(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and completions."""

    model: str
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    temperature: Union[Temperature, None] = None
    top_p: Union[TopP, None] = None
    n: Union[int, None] = None
    stop: StopField = None
    seed: Union[int, None] = None
    # An end-user id for abuse tracking: it changes no output, we keep no record.
    user: Union[str, None] = None
    # chat's true/false (with top_logprobs), completions' count; the penalties,
    # logit_bias and the extra sampling fields come from SamplingFields
    logprobs: Union[bool, int, None] = None
    # Per-request idle timers (P10): Ollama's keep_alive and LM Studio's ttl.
    keep_alive: KeepAlive = None
    ttl: Union[int, None] = None
    # false: the worker never guesses ahead (speculative decoding); null or true: it may
    speculative: Union[bool, None] = None


class FunctionDef(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class ToolDef(Struct, kw_only=True):
    type: str
    function: Union[FunctionDef, None] = None


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: Union[str, None] = None
    schema: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Union[JsonSchemaFormat, None] = None


class ChatRequest(_Sampling, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessageIn]
    max_tokens: Union[MaxTokens, None] = None
    max_completion_tokens: Union[MaxTokens, None] = None
    top_logprobs: Union[int, None] = None
    # Honoured: tool calling and structured output.
    tools: Union[list[ToolDef], None] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Union[bool, None] = None
    response_format: Union[ResponseFormat, None] = None
    # Accepted with no effect on the output, truthfully:
    metadata: Union[dict[str, str], None] = None  # only kept with store=true, which is refused
    store: Union[bool, None] = None  # false/null only: we store nothing
    safety_identifier: Union[str, None] = None  # abuse tracking id, like user
    prompt_cache_key: Union[str, None] = None  # routing hint; our prompt cache is automatic (H1)
    prompt_cache_retention: Union[str, None] = None  # ditto: the cache's lifetime is the guard's (H2)
    prompt_cache_options: Any = None  # ditto
    service_tier: Union[str, None] = None  # billing/latency class; one tier here, same output
    prediction: Any = None  # a latency hint; OpenAI's output is the same with it
    # Refused unless null (or their only neutral value, see openai.py):
    modalities: Union[list[str], None] = None  # ["text"] only
    audio: Any = None
    functions: Any = None  # deprecated for tools
    function_call: Any = None  # deprecated for tool_choice
    reasoning_effort: Union[str, None] = None
    verbosity: Union[str, None] = None
    web_search_options: Any = None
    moderation: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    """`POST /v1/completions` (the legacy text completion).

    `prompt`: a string, a list of strings, token ids, or a list of token-id lists
    (msgspec takes one array type in a union, so http/completions.py reads it);
    `max_tokens` 0 only with `echo` (the prompt scored, nothing generated)."""

    prompt: Any
    max_tokens: Union[Annotated[int, Meta(ge=0, le=1_000_000)], None] = None
    echo: bool = False
    suffix: Union[str, None] = None
    best_of: Union[int, None] = None


class GuardSettingsIn(Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /admin/guard` (SPEC T6). Sizes as everywhere: "12GiB", "1536MiB" or bytes."""

    tier: Union[str, None] = None
    custom_ceiling: Union[int, str, None] = None
    enabled: Union[bool, None] = None
    custom_device_ceiling: Union[int, str, None] = None  # D2


# ---------------------------------------------------------------------------
# responses


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0  # H1: prompt tokens the worker's prompt cache supplied (memory and disk)
    disk_cached_tokens: int = 0  # H5 (proposed): the part of cached_tokens read back from the disk tier


class CompletionTokensDetails(Struct, kw_only=True):
    """Speculative decoding: guessed tokens the model chose too, and those it did not (OpenAI's
    names, from its Predicted Outputs); only when the request guessed at all."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: Union[CompletionTokensDetails, msgspec.UnsetType] = msgspec.UNSET


class ChatMessageOut(Struct, kw_only=True, omit_defaults=True):
    role: str
    content: Union[str, None]
    tool_calls: Union[list[ToolCall], msgspec.UnsetType] = msgspec.UNSET


# -- logprobs, as OpenAI shapes them (http/sampling_options.py fills them) ------
class TopLogprobOut(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: Union[list[int], None] = None  # the token's UTF-8 bytes


class LogprobOut(Struct, kw_only=True):
    """One generated token's logprob: chat's `logprobs.content[i]`, Responses' and Ollama's too."""

    token: str
    logprob: float
    bytes: Union[list[int], None] = None
    top_logprobs: list[TopLogprobOut] = []


class ChoiceLogprobs(Struct, kw_only=True):
    """Chat's `choices[i].logprobs` (whole, or the tokens of one streamed chunk)."""

    content: Union[list[LogprobOut], None]
    refusal: None = None


class CompletionLogprobs(Struct, kw_only=True):
    """Legacy completions' `choices[i].logprobs`: columns, one entry per token (an echoed
    prompt's first token has null for its logprob and alternatives, as OpenAI's)."""

    tokens: list[str]
    token_logprobs: list[Union[float, None]]
    top_logprobs: list[Union[dict[str, float], None]]
    text_offset: list[int]
# -- end of logprobs -------------------------------------------------------------------


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: ReplyFinishReason
    logprobs: Union[ChoiceLogprobs, None] = None


class _Completion(Struct, Generic[C], kw_only=True):
    """What every completion and streamed chunk opens with."""

    id: str
    created: int
    model: str
    choices: list[C]


class ChatCompletion(_Completion[ChatChoice], kw_only=True):
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: Union[str, None] = None


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: Union[str, None] = None
    content: Union[str, None] = None
    tool_calls: Union[list[ToolCall], None] = None  # each with its index


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: Union[ReplyFinishReason, None] = None
    logprobs: Union[ChoiceLogprobs, None] = None


class _Chunk(_Completion[C], kw_only=True):
    """A streamed chunk. With `include_usage` every chunk carries `usage: null`
    and one last chunk (no choices) the counts, as OpenAI does; without it the
    field is left out."""

    object: str  # each kind sets its own as the default
    usage: Union[Usage, None, msgspec.UnsetType] = msgspec.UNSET


class ChatChunk(_Chunk[ChunkChoice], kw_only=True):
    """One SSE event of a streamed chat completion."""

    object: str = "chat.completion.chunk"


class TextChoice(Struct, kw_only=True):
    index: int
    text: str
    finish_reason: Union[ReplyFinishReason, None] = None
    logprobs: Union[CompletionLogprobs, None] = None


class TextCompletion(_Chunk[TextChoice], kw_only=True):
    """Both the whole legacy completion and each of its streamed chunks."""

    object: str = "text_completion"


class ModelCard(Struct, kw_only=True):
    """OpenAI's model object plus what the supervisor knows about residency."""

    id: str
    created: int
    owned_by: str = "memvisor"
    object: str = "model"
    state: str = "unloaded"
    pinned: bool = False
    worker: Union[str, None] = None
    pid: Union[int, None] = None
    # the model's context window in tokens (config.json), where known
    context_length: Union[int, None] = None
    # what it does, in Ollama's words ("completion", "tools", "insert", or "embedding" alone),
    # and "chat" where a chat template makes /v1/chat/completions usable
    capabilities: Union[list[str], None] = None
    # Everything `ps` shows: aliases, estimated vs measured bytes, idle time, expiry ...
    memvisor: Union[ModelInfo, None] = None
    # what a request sent now would meet (the routing signal; GET /health?model=ID)
    readiness: Union[Readiness, None] = None


class ModelList(Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: Union[str, None] = None
    code: Union[ErrorCode, None] = None
    # Set for memory refusals (SPEC A3, G1): the figures behind the refusal.
    binding: Union[str, msgspec.UnsetType] = msgspec.UNSET
    estimated_bytes: Union[int, msgspec.UnsetType] = msgspec.UNSET
    limit_bytes: Union[int, msgspec.UnsetType] = msgspec.UNSET
    # a model still loading, for a request that would not wait for it
    progress: Union[LoadProgress, msgspec.UnsetType] = msgspec.UNSET


class ErrorBody(Struct, kw_only=True):
    error: ErrorDetail


# ---------------------------------------------------------------------------
# decoding at the edge

UNKNOWN = "unknown field: this server does not support it, and says so rather than ignore it"
_AT_PATH = re.compile(r"^(?P<reason>.*) - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$", re.S)


# Deepest nesting of arrays and objects a body may have. No request shape
# needs more than a handful; msgspec recurses per level, and a body nested
# 3,000 deep raised RecursionError (a 500).
MAX_JSON_DEPTH = 64
_BRACKETS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when arrays/objects nest deeper than `limit` (strings skipped)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case costs two C-speed counts
    depth = 0
    for match in _BRACKETS.finditer(body):
        token = match[0]
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def decode_body(body: bytes, type_: type[T]) -> T:
    """Decode and validate a JSON body, or raise BodyError naming the field."""
    if json_depth_exceeds(body):
        raise BodyError(f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return msgspec.json.decode(body, type=type_)
    except RecursionError:  # a belt to the depth check's braces
        raise BodyError(f"the request body nests too deeply (limit {MAX_JSON_DEPTH} levels)") from None
    except msgspec.ValidationError as exc:
        reason, path = _split_path(str(exc))
        raise BodyError(f"{path}: {reason}" if path else reason, param=path or None) from None
    except msgspec.DecodeError as exc:
        what = "the request body is empty" if not body.strip() else f"the request body is not valid JSON ({exc})"
        raise BodyError(what + "; send a JSON object") from None


def _split_path(text: str) -> tuple[str, str]:
    """msgspec's "Expected `int`, got `str` - at `$.max_tokens`" -> (reason, "max_tokens")."""
    match = _AT_PATH.match(text)
    if match is None:
        unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
        return ((UNKNOWN, unknown[1]) if unknown else (text, ""))
    reason, path = match["reason"], match["path"].lstrip(".")
    if match["key"]:  # a map's key (logit_bias' token ids)
        reason = f"a key: {reason}"
    unknown = re.match(r"Object contains unknown field `([^`]+)`", reason)
    if unknown:
        return UNKNOWN, f"{path}.{unknown[1]}" if path else unknown[1]
    return reason, path
