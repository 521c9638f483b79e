"""Per-request token choice built on mlx_lm's sampling pieces.

Why not one global sampler: sequences of different requests interleave in one
process (rows of one batch), each with its own settings: temperature, top_p,
top_k, min_p, penalties on what it already said, a logit bias, a seed, and
whether it reports logprobs. So each request gets its own `TokenPicker`,
called on its own row of logits, and nothing of one row's state (its token
history, its PRNG key, its pending logprobs) can reach another's.

Why a seed carries its own key: a seeded request must draw the same tokens
whatever else runs beside it, so it never touches MLX's global random state.

Why greedy stays a bare function: a batch gives every row whose sampler *is*
`greedy` one shared argmax (worker/batch.py), so plain greedy rows cost
nothing per row; a row with penalties, a bias or logprobs at temperature 0
has a picker, whose argmax of unchanged logits is the same token.

Logprobs are the log-softmax of the logits after the processors (bias,
penalties) and before temperature and the top-k / top-p / min-p filters, as
mlx_lm reports them: what the model (as steered) thought, not the sampler's
truncated distribution. They are computed lazily beside the token and
queued with it (`mx.async_eval`), so reading them when the token is emitted,
one step later, waits for nothing the token did not.
"""

from __future__ import annotations

import math
from collections import deque
from functools import partial
from typing import Callable, Sequence, Union, cast

import mlx.core as mx
import msgspec
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    make_logits_processors,
)

from shared.protocol import MAX_TOP_LOGPROBS, Generate, TokenLogprobs, TopLogprob

# At or below this temperature a request is greedy (`Settings.__post_init__`, the one place
# every API's temperature passes). Why a floor at all: sampling divides the log-probabilities
# by the temperature in float32, whose largest value is 3.4e38; at 1e-40 (float32 cannot even
# hold it) or 1e-300 the scale 1/T overflowed to inf, every scaled value became -inf or NaN,
# and the draw was uniform: the reply changed with the seed. Why 1e-5: at 1/T = 1e5 a draw
# differs from argmax only between tokens whose log-probabilities lie within ~2e-4 of each
# other (the Gumbel noise of a float32 draw spans ~21), finer than a trained model's float16
# or bfloat16 logits resolve (a step of ~1e-3 at magnitude 1 in float16, ~8e-3 in bfloat16):
# below it sampling is argmax plus noise on near-ties, which greedy settles, and it stays
# far above where the float32 arithmetic breaks (1/T past 3.4e38, below ~3e-39). vLLM draws the
# same line (its _SAMPLING_EPS, 1e-5).
GREEDY_AT_OR_BELOW = 1e-5

Sampler = Callable[[mx.array], mx.array]
Filter = Callable[[mx.array], mx.array]
Pending = tuple[mx.array, Union[mx.array, None], Union[mx.array, None]]  # a token's logprob, top ids, top logprobs


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """How one request chooses its tokens: the sampling fields of the wire's `Generate`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: Union[int, None] = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[int, float] = {}
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        # a temperature at or below the floor is greedy (GREEDY_AT_OR_BELOW says why), for
        # the sampler, the batch's shared argmax and the seed alike; 0, a negative or a NaN
        # value stay as they are for `check` to judge
        if 0 < self.temperature <= GREEDY_AT_OR_BELOW:
            msgspec.structs.force_setattr(self, "temperature", 0.0)

    @classmethod
    def of(cls, cmd: Generate) -> Settings:
        """The request's settings, field for field (the names are the wire's)."""
        return cls(**{name: getattr(cmd, name) for name in cls.__struct_fields__})

    def penalties(self) -> list[tuple[float, int]]:
        """(penalty, look-back) of each penalty that changes anything."""
        return [(value, size) for value, size, neutral in (
            (self.repetition_penalty, self.repetition_context_size, 1.0),
            (self.presence_penalty, self.presence_context_size, 0.0),
            (self.frequency_penalty, self.frequency_context_size, 0.0)) if value != neutral and size > 0]

    @property
    def plain_greedy(self) -> bool:
        """argmax of the model's own logits, and nothing to report beside the token."""
        return self.temperature == 0 and not self.logprobs and not self.logit_bias and not self.penalties()


def check(s: Settings, vocab: int | None) -> str | None:
    """What is wrong with the settings, in words naming the field; None when they are usable.

    The front doors bound the same fields in their own terms; this is the worker's
    own guard, since a bad value reaching MLX would fail inside a batched step."""
    if not (s.temperature >= 0 and math.isfinite(s.temperature)):
        return f"temperature must be >= 0, got {s.temperature}"
    if not 0 < s.top_p <= 1:
        return f"top_p must be in (0, 1], got {s.top_p}"
    if s.top_k < 0:
        return f"top_k must be >= 0 (0: off), got {s.top_k}"
    if not 0 <= s.min_p <= 1:
        return f"min_p must be in [0, 1], got {s.min_p}"
    if not (s.repetition_penalty > 0 and math.isfinite(s.repetition_penalty)):
        return f"repetition_penalty must be a finite number above 0, got {s.repetition_penalty}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(s, name)):
            return f"{name} must be finite"
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        if getattr(s, name) < 0:
            return f"{name} must be >= 0 (0: off), got {getattr(s, name)}"
    for token, bias in s.logit_bias.items():
        if vocab is not None and not 0 <= token < vocab:
            return f"logit_bias: token id {token} is outside the model's vocabulary [0, {vocab})"
        if not math.isfinite(bias):
            return f"logit_bias: the bias of token {token} must be finite"
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}"
    return None


def greedy(logits: mx.array) -> mx.array:
    # argmax of logits equals argmax of log-probabilities: skip the logsumexp.
    return mx.argmax(logits, axis=-1)


def make_request_sampler(s: Settings, prompt: Sequence[int] = ()) -> Sampler:
    """`greedy` for plain greedy requests (the batch's shared argmax), else a `TokenPicker`."""
    return greedy if s.plain_greedy else TokenPicker(s, prompt)


def filters(s: Settings) -> list[Filter]:
    """mlx_lm's filters on log-probabilities, in its make_sampler's order (top_p, min_p, top_k)."""
    out: list[Filter] = []
    if 0 < s.top_p < 1:
        out.append(partial(apply_top_p, top_p=s.top_p))
    if s.min_p > 0:
        out.append(partial(apply_min_p, min_p=s.min_p))
    if s.top_k > 0:
        out.append(partial(_top_k, top_k=s.top_k))
    return out


def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """mlx_lm's top-k; k at or past the vocabulary keeps every token (mlx_lm would raise)."""
    return apply_top_k(logprobs, top_k) if top_k < logprobs.shape[-1] else logprobs


class TokenPicker:
    """One request's choice of each next token (see module doc).

    Called with the request's own row of logits, shape (1, vocab); returns the
    token, shape (1,). The tokens it returned are the history its penalties
    look back on (after the prompt's tail), and, when logprobs are asked for,
    each token's logprobs wait in `pending` until `take` reads them.
    """

    __slots__ = ("processors", "reach", "history", "temperature", "filters", "key", "top", "pending", "shared")

    def __init__(self, s: Settings, prompt: Sequence[int] = ()) -> None:
        penalties = s.penalties()
        # make_logits_processors switches a penalty on when it is not None (a 1.0 repetition
        # penalty would still cost a gather and a scatter per token), so neutral ones stay None
        self.processors = make_logits_processors(
            logit_bias=s.logit_bias or None,
            repetition_penalty=_unless(s.repetition_penalty, 1.0, s.repetition_context_size),
            repetition_context_size=s.repetition_context_size,
            presence_penalty=_unless(s.presence_penalty, 0.0, s.presence_context_size),
            presence_context_size=s.presence_context_size,
            frequency_penalty=_unless(s.frequency_penalty, 0.0, s.frequency_context_size),
            frequency_context_size=s.frequency_context_size)
        self.reach = max((size for _, size in penalties), default=0)
        # what the penalties look back on (empty, and never grown, when there are none)
        self.history = mx.array(list(prompt[-self.reach:]) if self.reach else [], mx.uint32)
        self.temperature = s.temperature
        self.filters = filters(s) if s.temperature > 0 else []
        # OpenAI seeds are int64 and may be negative; MLX keys take uint64 only
        # (a negative one raised TypeError and took the whole worker down).
        self.key = mx.random.key(s.seed & 0xFFFF_FFFF_FFFF_FFFF) if s.seed is not None and s.temperature > 0 else None
        self.top = min(s.top_logprobs, MAX_TOP_LOGPROBS) if s.logprobs else -1
        self.pending: deque[Pending] = deque()
        # Pickers with equal `shared` keys choose alike from any rows, remember nothing and report
        # nothing: `pick_rows` gives all their rows one pick. None: this one needs its own call.
        plain = not self.processors and self.top < 0 and self.key is None
        self.shared: tuple | None = (s.temperature, s.top_p, s.min_p, s.top_k) if plain else None

    def __call__(self, logits: mx.array) -> mx.array:
        if self.processors:
            logits = mx.array(logits)  # mlx_lm's repetition penalty writes into its logits: not the caller's
        for processor in self.processors:
            logits = processor(self.history, logits)
        token = self.choose(logits)
        if self.reach:
            self.history = mx.concatenate([self.history, token.astype(mx.uint32)])[-self.reach:]
        if self.top >= 0:
            self.pending.append(_logprobs(logits, token, self.top))
        return token

    def choose(self, logits: mx.array) -> mx.array:
        """The tokens of any rows of logits (rows, vocab), each chosen from its own row, without
        the processors (a `shared` picker has none): `pick_rows` calls it for many rows at once."""
        if self.temperature == 0:
            return greedy(logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for step in self.filters:
            logprobs = step(logprobs)
        if self.key is None:
            return categorical_sampling(logprobs, self.temperature)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=sub)

    def take(self, token: int, text: Callable[[int], str]) -> TokenLogprobs:
        """The logprobs of the oldest token not yet emitted (which is `token`), with texts."""
        chosen, ids, values = self.pending.popleft()
        top: list[TopLogprob] = []
        if ids is not None and values is not None:
            # 1-D arrays: tolist() gives flat lists (MLX types it as any nesting)
            pairs = zip(cast(list[int], ids.tolist()), cast(list[float], values.tolist()))
            top = [TopLogprob(token=text(i), logprob=lp) for i, lp in sorted(pairs, key=lambda p: (-p[1], p[0]))]
        return TokenLogprobs(token=text(token), logprob=cast(float, chosen.item()), top=top)


GREEDY_KEY = ("greedy",)


def pick_rows(samplers: Sequence[tuple[int, Sampler]], logits: mx.array) -> list[tuple[list[int], mx.array]]:
    """Row i's next token for each (i, its sampler), as (rows, their tokens) pairs, in as few
    MLX calls as the settings allow.

    Why: a sampler call per row is a handful of small MLX ops per row per step (logsumexp,
    filters, categorical, a key split), each a kernel launch on a GPU; at 64 streams with a
    temperature that was hundreds of launches a step beside one forward pass. Rows whose
    samplers choose alike (`greedy`, or pickers with equal `TokenPicker.shared`) take one
    gather and one pick together: the ops work row by row, so each row's token is drawn
    from its own row's distribution as before (unseeded rows share MLX's global generator
    either way). Penalties, a bias, logprobs or a seed keep a row's own call.
    """
    together: dict[tuple, list[int]] = {}
    pickers: dict[tuple, Sampler] = {}
    out: list[tuple[list[int], mx.array]] = []
    for i, sample in samplers:
        key = GREEDY_KEY if sample is greedy else sample.shared if type(sample) is TokenPicker else None
        if key is None:
            out.append(([i], sample(logits[i:i + 1])))
            continue
        together.setdefault(key, []).append(i)
        pickers[key] = sample
    for key, rows in together.items():
        sample = pickers[key]
        choose = greedy if sample is greedy else cast(TokenPicker, sample).choose
        out.append((rows, choose(logits[rows[0]:rows[0] + 1] if len(rows) == 1 else logits[mx.array(rows)])))
    return out


def _unless(value: float, neutral: float, size: int) -> float | None:
    return value if value != neutral and size > 0 else None


def _logprobs(logits: mx.array, token: mx.array, top: int) -> Pending:
    """The token's logprob and the `top` best (ids, logprobs), lazy and already queued."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, token.reshape(1, 1).astype(mx.int32), axis=-1).reshape(())
    top = min(top, logprobs.shape[-1])
    if top == 0:
        mx.async_eval(chosen)
        return chosen, None, None
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[0, :top]
    values = logprobs[0, ids]
    mx.async_eval(chosen, ids, values)
    return chosen, ids, values


class TokenTexts:
    """Each token's own text (its piece, decoded alone), remembered: the logprobs name tokens
    by text, since the supervisor has no tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._known.get(token)
        if text is None:
            text = self._known[token] = self._tokenizer.decode([token])
        return text
