"""The check of a request's guesses in one forward pass (worker/speculate.py says why and when).

Apart from the guessing itself because the check needs the request and its events
(worker/request.py, worker/endings.py), and the request holds its guessing state: one
module for both made a circle of the three.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from worker.batch import DecodeBatch
from worker.sampling import greedy
from worker.speculate import Costs, Odds

if TYPE_CHECKING:
    from worker.endings import Event
    from worker.request import Seq


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
           events: list[Event], costs: Costs, odds: Odds) -> bool:
    """One checked step of the batch's only row: emit `first` (the token in flight) and the
    accepted guesses, put the model's next choice in flight; True when the request ended
    (the guesses it accepted are counted in `seq.spec`). The pass's time teaches `costs`, its
    outcome `odds` (those of the source that guessed).

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
    costs.learn_check(len(drafts) + 1, time.perf_counter() - started)
    odds.checked(len(drafts), accepted)
    if not ended:
        batch.y = choices[accepted:accepted + 1]
    return ended
