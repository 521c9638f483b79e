"""Fair prefill (worker/scheduler.py): a prefill turn's token budget is shared by every request
prefilling, so a short prompt never waits for a long prompt's whole prefill, and greedy output
stays token-identical to each request alone. Real tiny models on the CPU."""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.protocol import NeedMemory, Prompted, TokenOut
from shared.sizes import GiB
from tests.engine_harness import Run, drive
from worker import prefill_guard as guard
from worker.engine import Engine

OPEN = Limits(max_concurrency=8)


def _engine(loaded, **kwargs) -> Engine:
    model, tokenizer = loaded
    kwargs.setdefault("own_usage_fn", lambda: 0)
    return Engine(model, tokenizer, **kwargs)


def _timed(engine: Engine, tokens: int) -> None:
    """As if chunks had been timed: a turn's budget is `tokens` (what runs in chunk_seconds)."""
    engine.chunk_timer.per_token = engine.chunk_timer.seconds / tokens


def _first_token_step(engine: Engine, rid: str, limits: Limits = OPEN, usage=lambda: 0) -> tuple[int, list]:
    events: list = []
    for step in range(10_000):
        out = engine.step(limits, usage)
        events += out
        if any(isinstance(ev, TokenOut) and ev.request_id == rid for ev in out):
            return step, events
    raise AssertionError(f"{rid} got no token")


def _replies_alone(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy reply served alone by `engine`, one after the other."""
    alone = {}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=max_tokens)
        alone[rid] = drive(engine).tokens(rid)
    return alone


@pytest.mark.parametrize("order", ["shortest", "round_robin"])
def test_fair_prefill_a_short_prompt_is_not_held_behind_a_long_prefill(loaded, order):
    """The 252.8 s wait: a 117-token request sent while a 6,969-token prompt prefilled got its
    first token only after the long prefill. With the turn's budget shared it comes long before
    the long prompt's first token, and both replies are those of each request alone."""
    engine = _engine(loaded, max_chunk=64, prefill_order=order)
    long_prompt = engine.encode_prompt("word " * 400)
    short_prompt = engine.encode_prompt("Once upon a time")
    alone = _replies_alone(engine, {"long": long_prompt, "short": short_prompt}, 6)
    _timed(engine, 24)
    engine.submit("long", long_prompt, max_tokens=6)
    engine.step(OPEN, lambda: 0)
    engine.step(OPEN, lambda: 0)  # the long prompt is prefilling
    engine.submit("short", short_prompt, max_tokens=6)
    step, events = _first_token_step(engine, "short")
    assert not any(isinstance(ev, TokenOut) and ev.request_id == "long" for ev in events)
    assert step <= 4, f"the short prompt waited {step} steps"
    assert engine.scheduler.line and engine.scheduler.line[0].id == "long" and engine.scheduler.line[0].pos < 300
    run = drive(engine)
    ordered = [ev for ev in events + run.events if isinstance(ev, TokenOut)]
    for rid in ("long", "short"):
        assert [ev.token_id for ev in ordered if ev.request_id == rid] == alone[rid], rid


def test_fair_prefill_a_turn_runs_its_budget_shared_by_every_prefilling_request(loaded):
    """Each turn runs at most its budget of prompt tokens, whoever prefills, so a running stream
    waits for one budgeted turn between two tokens, not for another request's whole chunk."""
    engine = _engine(loaded, max_chunk=64, prefill_order="round_robin")
    engine.scheduler.decode.batched = False  # no group: each prefills alone, sharing the turn
    _timed(engine, 30)
    for rid, words in (("a", 120), ("b", 150)):
        engine.submit(rid, engine.encode_prompt("hello " * words), max_tokens=3)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    while engine.scheduler.queue or engine.scheduler.line:
        before = engine.prompt_tokens_processed
        engine.step(OPEN, lambda: 0)
        _timed(engine, 30)  # what the chunks just taught the timer is put back
        assert engine.prompt_tokens_processed - before <= 30 + 2  # the budget (and a first token each)
        for seq in engine.scheduler.line:
            seen[seq.id].append(seq.pos)
    assert all(len(set(pos)) > 2 for pos in seen.values()), seen
    drive(engine)


def test_fair_prefill_shortest_first_serves_the_fewest_tokens_left_first(loaded):
    engine = _engine(loaded, max_chunk=64)
    engine.scheduler.decode.batched = False
    _timed(engine, 20)
    engine.submit("long", engine.encode_prompt("word " * 200), max_tokens=2)
    engine.step(OPEN, lambda: 0)
    engine.submit("short", engine.encode_prompt("word " * 30), max_tokens=2)
    _timed(engine, 20)  # what the first chunk taught the timer is put back
    engine.step(OPEN, lambda: 0)  # admitted; the turn goes to the shortest first
    short = next(seq for seq in engine.scheduler.line if seq.id == "short")
    long = next(seq for seq in engine.scheduler.line if seq.id == "long")
    assert short.pos == 20 and long.pos == 20, "the whole budget went to the shortest"
    drive(engine)


def test_fair_prefill_a_turn_ends_at_a_first_token_rather_than_run_a_chunk_that_makes_none(loaded):
    """A step's events leave at its end: a turn that made the short prompt's first token and then
    gave the rest of its budget to the long prompt held that token back for the long chunk (it
    leaves with the decode step after the turn). The turn now ends at the first token; the long
    prompt runs its share at its next prefill turn, and both replies stay those of each request
    alone."""
    solo = _engine(loaded, max_chunk=64)  # the replies alone, from an engine of their own (its prompt cache)
    long_prompt = solo.encode_prompt("word " * 300)
    short_prompt = solo.encode_prompt("Once upon a time")
    alone = _replies_alone(solo, {"long": long_prompt, "short": short_prompt}, 4)
    engine = _engine(loaded, max_chunk=64)
    engine.scheduler.decode.batched = False  # no group: each prefills alone, sharing the turn
    _timed(engine, 40)
    engine.submit("long", long_prompt, max_tokens=4)
    engine.step(OPEN, lambda: 0)  # the long prompt is prefilling
    engine.submit("short", short_prompt, max_tokens=4)
    events: list = []
    while True:
        _timed(engine, 40)  # what the chunks just taught the timer is put back
        long = next(seq for seq in engine.scheduler.line if seq.id == "long")
        before = long.pos
        events += engine.step(OPEN, lambda: 0)
        if any(seq.id == "short" for seq in engine.scheduler.decoding):
            break  # its prefill made its first token in this turn (it leaves at the next decode step)
    assert long.pos == before, f"the long prompt ran {long.pos - before} tokens in the turn of the short's first token"
    run = drive(engine)
    ordered = [ev for ev in events + run.events if isinstance(ev, TokenOut)]
    for rid in ("long", "short"):
        assert [ev.token_id for ev in ordered if ev.request_id == rid] == alone[rid], rid


# G1's limit and G2's target are both the hard limit, nothing shrinks chunks near it
TIGHT = Limits(hard_limit=10 * GiB, prefill_headroom_safety=1.0, binding="dynamic", min_chunk_tokens=4,
               max_concurrency=4)


def test_g1_a_prefill_starting_beside_another_counts_the_kv_the_other_will_still_grow(loaded):
    """Two prompts that fit one after the other but not both at once: before fair prefill the
    second waited behind the first's whole prefill, and G1 saw the first's KV in the usage.
    Beside it, G1 counts what the first will still grow: the second waits for it (no eviction
    asked, nothing refused) and starts once the first is done."""
    engine = _engine(loaded, max_chunk=16)
    engine.scheduler.decode.batched = False
    first = engine.encode_prompt("word " * 600)
    second = engine.encode_prompt("hello " * 50)  # shorter: served first in each turn
    engine.submit("first", first, max_tokens=2)
    engine.step(TIGHT, lambda: 0)
    head = engine.scheduler.line[0]
    # room for the first's largest chunk (and then some), not for the second beside its growth
    usage = TIGHT.hard_limit - int(1.5 * guard.padded_chunk_bytes(engine.cost, len(first) - 17, 16))
    engine.submit("second", second, max_tokens=2)
    events: list = []
    held = 0
    while head.state == "prefill":
        alone = guard.admission_peak(len(second), engine.cost, TIGHT.min_chunk_tokens)
        blocked = usage + alone + engine.prefill.reserved([head]) > TIGHT.hard_limit
        assert usage + alone <= TIGHT.hard_limit, "the second does not fit even alone"
        events += engine.step(TIGHT, lambda: usage)
        if blocked:  # the second, shorter, is served first in the turn: its G1 saw this reading
            waiting = [seq for seq in engine.scheduler.line if seq.id == "second"]
            assert waiting and waiting[0].state == "preflight", "the second started beside the first's growth"
            held += 1
    assert held > 3
    assert not any(isinstance(ev, NeedMemory) for ev in events), events
    run = Run()
    run.add(events + drive(engine, TIGHT, lambda: usage).events)
    assert any(isinstance(ev, Prompted) and ev.request_id == "second" for ev in run.events)
    assert run.terminal("second").finish_reason == "length"
