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

**Checking** (`verify`): the token in flight and the K guesses go through the
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
`Pace` keeps guessing from costing a request time where guesses miss: it
drafts fewer tokens after a miss (or a check that emitted its tokens slower
than plain steps would have) and pauses for a growing number of steps after
misses in a row (scripts/bench_speculative.py measures a free chat
beside an edit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from worker.batch import DecodeBatch
from worker.sampling import greedy

if TYPE_CHECKING:  # request.py imports this module
    from worker.draft import DraftState
    from worker.endings import Event
    from worker.request import Seq

MIN_NGRAM = 2      # a single repeated token guesses too often to pay for its checks
MAX_NGRAM = 3
FIRST_DRAFT = 2    # tokens drafted at first; more after guesses that were all right
MAX_DRAFT = 6
MAX_PAUSE = 32     # steps without guessing, at most, after misses in a row


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


class Pace:
    """How many tokens to draft now: more after guesses that were all right (up to the most
    that paid), fewer after a miss, and after misses in a row a pause (1, 2, 4 ... MAX_PAUSE
    steps) before guessing again.

    Why a ceiling: what a check costs depends on the machine. On a CPU with OpenBLAS a pass
    over 7 tokens of a 100 MiB float32 model cost 1.7 passes of one, so drafting more pays;
    MLX's quantized matmul on the same CPU cost 1.8 passes for 3 tokens and 5.5 for 5
    (SmolLM2-135M Q4_1), so guesses that all held still lost time past 2. A check whose
    tokens came slower than plain steps (`paid` False) although its guesses held caps the
    draft below its size for the rest of the request."""

    __slots__ = ("k", "pause", "misses", "ceiling")

    def __init__(self) -> None:
        self.k = FIRST_DRAFT
        self.pause = 0
        self.misses = 0
        self.ceiling = MAX_DRAFT

    def want(self) -> int:
        """Tokens to draft this step, 0 while pausing (each call is one step)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def learn(self, proposed: int, accepted: int, paid: bool = True) -> None:
        """After a check of `proposed` guesses of which `accepted` held; `paid` False: the checked
        step emitted its tokens slower than plain steps emit one each."""
        if not paid and accepted == proposed and proposed > FIRST_DRAFT:
            self.ceiling = self.k = max(FIRST_DRAFT, proposed - 2)  # the guesses held: a smaller check may pay
            return
        if accepted == 0 or not paid:
            self.misses += 1
            self.k = FIRST_DRAFT
            self.pause = min(MAX_PAUSE, 1 << (self.misses - 1))
            return
        self.misses = 0
        if accepted == proposed:
            self.k = min(self.ceiling, self.k + 2)
        else:
            self.k = max(FIRST_DRAFT, min(self.ceiling, accepted + 1))


class Speculation:
    """One request's guessing: its drafter (built on first use), its KV in the draft model (when
    the worker has one, worker/draft.py), pace and counts."""

    __slots__ = ("drafter", "draft", "pace", "proposed", "accepted")

    def __init__(self) -> None:
        self.drafter: NgramDrafter | None = None
        self.draft: DraftState | None = None
        self.pace = Pace()
        self.proposed = 0   # guessed tokens checked
        self.accepted = 0   # ... that the model chose too (and were emitted)


def accepted_count(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading guesses equal the model's choice at their position (`targets[i]` is its
    choice after the token in flight and the first i guesses)."""
    count = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        count += 1
    return count


Emit = Callable[["Seq", int, "list[Event]"], bool]  # DecodeStep.emit: (seq, token, events) -> ended


def verify(model, batch: DecodeBatch, seq: Seq, first: int, drafts: list[int], emit: Emit,
           events: list[Event], plain_seconds: float = 0.0) -> bool:
    """One checked step of the batch's only row: emit `first` (the token in flight) and the
    accepted guesses, put the model's next choice in flight; True when the request ended
    (the guesses it accepted are counted in `seq.spec`). `plain_seconds`: what a plain step of
    one row takes (0: not known yet); a check whose tokens came slower than that teaches `Pace`.

    The KV keeps exactly the tokens emitted (the rejected guesses' positions are rewound),
    so a request that ends here leaves the prompt cache the KV of its prompt and output."""
    started = time.perf_counter()
    with mx.stream(generation_stream):
        logits = batch.verify(model, [first, *drafts])
        choices = greedy(logits)
    targets = cast(list[int], choices.tolist())  # 1-D ids
    accepted = accepted_count(drafts, targets)
    fed = 0
    ended = False
    for token in [first, *drafts[:accepted]]:
        fed += 1
        if emit(seq, token, events):
            ended = True
            break
    batch.rewind(len(drafts) + 1 - fed)
    spec = seq.spec
    assert spec is not None  # only a request that may guess comes here
    spec.proposed += len(drafts)
    spec.accepted += fed - 1
    elapsed = time.perf_counter() - started
    spec.pace.learn(len(drafts), accepted, paid=plain_seconds <= 0 or elapsed <= fed * plain_seconds)
    if not ended:
        batch.y = choices[accepted:accepted + 1]
    return ended
