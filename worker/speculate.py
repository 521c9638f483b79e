"""Speculative decoding: guess the next tokens cheaply, check them all in one forward pass.

Why: a decode step reads every weight of the model to produce one token. A
pass over K+1 tokens reads them once too, so when K guessed tokens are right,
K+1 tokens cost about one pass. On a Mac, one person chatting with one model
is the common case, and this is the one lever that makes that faster without
a bigger machine.

**Guesses** come from the request's own text (`NgramDrafter`, prompt lookup:
the tokens that followed the latest earlier occurrence of the last few tokens,
which is what an edit, a quote or code that repeats its names produces) or
from a small draft model of the same vocabulary (worker/draft.py).

**Checking** (worker/guess_check.py `verify`): the token in flight and the K guesses go through the
model in one pass over the request's KV; the model's own greedy choice at each
position is compared with the next guess, the leading guesses that match are
accepted, and the model's choice after the last of them is the next token in
flight. The positions of the rejected guesses are taken back out of the KV
(`DecodeBatch.rewind`). So every token emitted is the model's greedy choice
given the tokens before it, as in plain decoding: greedy output is
token-identical (tests/test_speculate.py, tests/live/test_worker_speculate_live.py).

**When**: greedy requests (temperature 0, no penalties, bias or logprobs, no
grammar) that decode alone in their worker (the decode batch has one row: a
row's KV shares one write position with the others, and guesses accepted in
different numbers would break it). A request may opt out (`speculative: false`).
Whether and how much to guess is decided at each step from what a check would cost
(`Costs`, timed on this machine) and how likely the guesses are right (`Odds`, counted
at every step): a check runs only where it promises more tokens per second than plain
steps, so guessing never costs a request more than the odd check that taught it
(scripts/bench_speculative.py measures a free chat beside an edit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.draft import DraftState

MIN_NGRAM = 2      # a single repeated token guesses too often to pay for its checks
MAX_NGRAM = 3
MAX_DRAFT = 16     # guesses checked in one pass, at most
PRIOR_SLOPE = 0.25  # what each guess adds to a check, in plain passes, until a check was timed
MARGIN = 1.05      # a check must promise this many times a plain step's tokens per second
FORGET = 0.95      # each observation of the odds weighs this much less than the next one
EMA = 0.2          # weight of the newest timing in the costs
STALLS = 2         # checks in a row slower than their tokens one at a time not kept (a stall, not a cost)
EXPLORE = 64       # steps with a guess but no check after which one check runs anyway (costs move)


class NgramDrafter:
    """Prompt lookup over one request's tokens (prompt and output), indexed as they come.

    `last[g]` is where the latest occurrence of n-gram `g` that is not the
    text's own suffix ends, so a guess is one dict lookup per n."""

    __slots__ = ("tokens", "last")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """One more token: the n-grams ending before it are now earlier occurrences."""
        end = len(self.tokens)
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            if end >= n:
                self.last[tuple(self.tokens[end - n:end])] = end
        self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest suffix seen before; [] when none was."""
        end = len(self.tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if end < n:
                continue
            start = self.last.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []


class Costs:
    """What a pass of the batch's only row costs on this machine, by the number of tokens in it, in
    plain passes (`ratio`), learned from the passes themselves: one per worker (decode.py).

    Why learned, not assumed: a pass over K+1 tokens costs about one pass where the weights' reading
    dominates (a float32 model with BLAS on a CPU: 16 tokens cost 1.7 passes of one, SmolLM2-135M), but
    about K+1 passes where arithmetic per row dominates: MLX's quantized matmul on a CPU dequantizes
    the weights again for every row (Q4_1: 3 tokens cost 2.5 passes, 16 cost 12). There a check pays
    only for guesses nearly sure to hold (scripts/bench_speculative.py --passes)."""

    __slots__ = ("plain", "checks", "stalls")

    def __init__(self) -> None:
        self.plain = 0.0                     # seconds of a plain step of one row (moving average)
        self.checks: dict[int, float] = {}   # tokens in a checked pass -> its plain passes (moving average)
        self.stalls: dict[int, int] = {}     # tokens -> checks in a row not kept as stalls

    def learn_plain(self, seconds: float) -> None:
        self.plain = _moving(self.plain or None, seconds)

    def learn_check(self, tokens: int, seconds: float) -> None:
        """A checked pass took `seconds`: kept in plain passes of the same moment (the machine's
        load moves both; on a shared machine a plain step took 0.13 s or 0.36 s from one request
        to the next), so it is learned only once a plain step was timed. A pass of K tokens costs at
        most K passes of one (it could be run as them): one that took longer met a stall (the
        machine's load, a first use: 74 passes for 5 tokens once), which would stop every check
        after it, and is not kept unless STALLS such checks in a row say that is what it costs."""
        if self.plain <= 0:
            return
        ratio = seconds / self.plain
        if ratio > tokens and self.stalls.get(tokens, 0) < STALLS:
            self.stalls[tokens] = self.stalls.get(tokens, 0) + 1
            return
        self.stalls[tokens] = 0
        self.checks[tokens] = _moving(self.checks.get(tokens), ratio)

    def ratio(self, tokens: int) -> float:
        """A pass over `tokens` tokens in plain passes: timed, else on the line through (1, 1) and
        the timed size nearest to it (PRIOR_SLOPE per token before any pass was timed)."""
        if tokens <= 1:
            return 1.0
        if not self.checks:
            return 1.0 + PRIOR_SLOPE * (tokens - 1)
        timed = self.checks.get(tokens)
        if timed is not None:
            return timed
        near = min(self.checks, key=lambda size: abs(size - tokens))
        slope = max(0.0, (self.checks[near] - 1.0) / (near - 1))
        return 1.0 + slope * (tokens - 1)


def _moving(average: float | None, value: float) -> float:
    """`average` moved toward `value` (EMA its weight); `value` itself when there is none yet."""
    return value if average is None else (1 - EMA) * average + EMA * value


class Odds:
    """How likely the drafter's next guess is right: after a right guess (text being copied: mostly
    right again) and after anything else. Counted at every step, checked or not: the token a plain
    step produces tells whether the guess made before it was right, for free. Older observations
    weigh less (FORGET), so a reply that stops copying stops being checked within a few tokens.

    `length` is the number of guesses to check now: the one that promises the most tokens per
    second, E(k) / cost(k + 1) with E(k) = 1 + p0 (1 + p1 + ... + p1^(k-1)) the tokens a check of k
    emits (p0 the chance of the first guess, p1 of one after a right one), or 0 (a plain step)
    where none promises MARGIN times a plain step's 1 / cost(1)."""

    __slots__ = ("right", "seen", "after_right", "pending", "at", "idle")

    def __init__(self) -> None:
        self.right = [1.0, 1.6]   # [after anything else, after a right guess]: priors 0.5 and 0.8
        self.seen = [2.0, 2.0]
        self.after_right = False
        self.pending: int | None = None  # the first guess of a step that did not check it
        self.at = -1                      # ... the position in the text it guessed
        self.idle = 0                     # plain steps with a guess since the last check

    def chance(self, after_right: bool) -> float:
        return self.right[after_right] / self.seen[after_right]

    def _count(self, right: bool) -> None:
        i = int(self.after_right)
        self.seen[i] = FORGET * self.seen[i] + 1.0
        self.right[i] = FORGET * self.right[i] + right
        self.after_right = right

    def guessed(self, guess: int | None, at: int) -> None:
        """A plain step runs with this guess of the token at position `at` (None: the drafter had
        none) unchecked."""
        self.pending, self.at = guess, at
        if guess is None:
            self.after_right = False
        else:
            self.idle += 1

    def saw(self, token: int, at: int) -> None:
        """The token at position `at`, which a plain step produced: was the guess of it right?
        (A guess of another position, from before steps in a batch of several rows, is dropped.)"""
        if self.pending is not None and self.at == at:
            self._count(token == self.pending)
        elif self.pending is not None:
            self.after_right = False
        self.pending = None

    def checked(self, proposed: int, accepted: int) -> None:
        """A check of `proposed` guesses of which the first `accepted` held."""
        self.pending, self.idle = None, 0
        for i in range(min(accepted + 1, proposed)):
            self._count(i < accepted)

    def length(self, costs: Costs, most: int) -> int:
        """After EXPLORE plain steps with a guess, the best size is checked even if it does not
        promise MARGIN: the costs were timed under another load, or a stall was kept."""
        first, next_ = self.chance(self.after_right), self.chance(True)
        best, best_gain, bar = 0, 0.0, MARGIN if self.idle < EXPLORE else 0.0
        emitted, reach = 1.0, first
        for k in range(1, most + 1):
            emitted += reach
            reach *= next_
            gain = emitted / costs.ratio(k + 1)
            if gain > best_gain:
                best, best_gain = k, gain
        return best if best_gain > bar else 0


class Speculation:
    """One request's guessing: its drafter (built on first use), its KV in the draft model (when
    the worker has one, worker/draft.py), the odds of each source's guesses and counts."""

    __slots__ = ("drafter", "draft", "odds", "draft_odds", "proposed", "accepted")

    def __init__(self) -> None:
        self.drafter: NgramDrafter | None = None
        self.draft: DraftState | None = None
        self.odds = Odds()        # the n-gram drafter's, observed at every step
        self.draft_odds = Odds()  # the draft model's, observed at its checks only (a guess costs its passes)
        self.proposed = 0   # guessed tokens checked
        self.accepted = 0   # ... that the model chose too (and were emitted)
