"""Requests prefilled together, on real tiny models (CPU, float16 and float32): requests that
arrive at once share their prefill passes, a group over G1's limit as a sum or short of room
mid-prefill (G2) is split, and every stream is token-identical to its request alone.
"""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from shared.sizes import GiB
from tests.batch_harness import DTYPES, load_tiny
from tests.batch_harness import Counting as _Counting
from tests.batch_harness import alone as _alone
from tests.engine_harness import OPEN, Run, drive
from worker.engine import Engine


@pytest.fixture(scope="module", params=DTYPES)
def loaded(request, tiny_model, tmp_path_factory):
    return load_tiny(request.param, tiny_model, tmp_path_factory)


# ------------------------------------------------------------------ requests prefilled together


def _prefill_passes(shapes: "_Shapes") -> list[int]:
    """Rows of every prefill pass (any pass not on the decode batch's own cache)."""
    return [rows for rows, decode in shapes.calls if not decode]


class _Shapes(_Counting):
    """The real model, recording (rows, whether it was a decode-batch step) of every forward pass."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, inputs, *args, **kwargs):
        from worker.batch import SlotKVCache

        self.calls.append((inputs.shape[0], isinstance(kwargs["cache"][0], SlotKVCache)))
        return self.model(inputs, *args, **kwargs)


GROUP = {"g1": "The memory guard watches every model", "g2": "A worker holds one model and more",
         "g3": "Once upon a time there was a", "g4": "def main(): return the answer"}


def test_requests_arriving_together_are_prefilled_in_one_pass_token_identical(loaded):
    """Four requests submitted at once share their prefill passes, get their first tokens in the
    same step (fair first-token times) and stream exactly what each gives alone."""
    model, tokenizer = loaded
    shapes = _Shapes(model)
    engine = Engine(shapes, tokenizer, own_usage_fn=lambda: 0, max_chunk=16)
    prompts = {rid: engine.encode_prompt(text) for rid, text in GROUP.items()}
    alone = _alone(engine, prompts, 12)
    shapes.calls.clear()
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=12)
    run = Run()
    first: dict[str, int] = {}
    for step in range(400):
        events = engine.step(OPEN, lambda: 0)
        run.add(events)
        for ev in events:
            if isinstance(ev, TokenOut):
                first.setdefault(ev.request_id, step)
        if not engine.has_work:
            break
    assert 4 in _prefill_passes(shapes), shapes.calls
    assert len(set(first.values())) == 1, first
    for rid in prompts:
        assert run.tokens(rid) == alone[rid], rid


def _tight_limits() -> Limits:
    """GUARDED with G2's target at the hard limit, no soft zone and a 1-token floor: the room
    left is exactly what the tests below give."""
    import msgspec

    from tests.engine_harness import GUARDED

    return msgspec.structs.replace(GUARDED, prefill_headroom_safety=1.0, soft_limit=0, min_chunk_tokens=1)


def _group_limits(engine: Engine, prompts: dict[str, list[int]], fit: int) -> tuple[Limits, int]:
    """Limits and a usage under which `fit` of the prompts' G1 estimates fit as a sum, not one more."""
    from worker import prefill_guard as guard

    limits = _tight_limits()
    padded = max(len(p) for p in prompts.values())
    one = max(guard.admission_peak(padded, engine.cost, limits.min_chunk_tokens),
              guard.padded_chunk_bytes(engine.cost, 0, 1))  # G1's estimate, or the first step's (G2)
    return limits, guard.prefill_limit(limits).bytes - one * fit - one // 2


def test_g1_a_group_over_the_limit_as_a_sum_is_split(loaded):
    """Each of four requests fits G1 alone, only two fit as a sum: the group is two, the rest
    follow, and every stream is identical to its request alone."""
    model, tokenizer = loaded
    shapes = _Shapes(model)
    engine = Engine(shapes, tokenizer, own_usage_fn=lambda: 0, max_chunk=16)
    prompts = {rid: engine.encode_prompt(text) for rid, text in GROUP.items()}
    alone = _alone(engine, prompts, 8)
    limits, usage = _group_limits(engine, prompts, 2)
    shapes.calls.clear()
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=8)
    run = drive(engine, limits, lambda: usage)
    assert max(_prefill_passes(shapes)) == 2, shapes.calls
    for rid in prompts:
        assert isinstance(run.terminal(rid), Finished), run.terminal(rid)
        assert run.tokens(rid) == alone[rid], rid


def test_g2_a_group_step_that_does_not_fit_is_split_and_each_goes_on_alone(loaded):
    """Mid-prefill the room shrinks so that a chunk cannot give every row one token: the group
    splits, each request keeps the KV it has and finishes alone, token-identical."""
    model, tokenizer = loaded
    shapes = _Shapes(model)
    engine = Engine(shapes, tokenizer, own_usage_fn=lambda: 0, max_chunk=16)
    prompts = {rid: engine.encode_prompt(text) for rid, text in GROUP.items()}
    alone = _alone(engine, prompts, 6)
    from worker import prefill_guard as guard

    limits = _tight_limits()
    readings = iter([1 * GiB] * 7)  # G1 (four members, the sum), the first chunk and its G3; then...

    def usage():
        # ...room for one row's 3-token chunk, less than one column for each of the 4 rows
        tight = guard.chunk_target(limits).bytes - guard.padded_chunk_bytes(engine.cost, 8, 3)
        return next(readings, tight)

    shapes.calls.clear()
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=6)
    run = drive(engine, limits, usage)
    assert 4 in _prefill_passes(shapes) and 1 in _prefill_passes(shapes), shapes.calls
    for rid in prompts:
        assert isinstance(run.terminal(rid), Finished), run.terminal(rid)
        assert run.tokens(rid) == alone[rid], rid


def test_a_request_that_alone_does_not_fit_is_rejected_and_the_others_are_grouped(loaded):
    model, tokenizer = loaded
    shapes = _Shapes(model)
    engine = Engine(shapes, tokenizer, own_usage_fn=lambda: 10 * GiB, max_chunk=16)
    prompts = {rid: engine.encode_prompt(text) for rid, text in GROUP.items()}
    big = engine.encode_prompt("word " * 2000)  # several KV blocks: far over the room
    limits, usage = _group_limits(engine, prompts, 3)
    shapes.calls.clear()
    engine.submit("big", big, max_tokens=4)
    for rid, prompt in list(prompts.items())[:3]:
        engine.submit(rid, prompt, max_tokens=4)
    run = drive(engine, limits, lambda: usage)
    end = run.terminal("big")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert 3 in _prefill_passes(shapes), shapes.calls
    assert all(isinstance(run.terminal(rid), Finished) for rid in list(prompts)[:3])
