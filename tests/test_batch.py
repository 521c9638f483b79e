"""Batched decode in the engine, on real tiny models (CPU, float16 and float32).

Every test here compares against what the same request gives alone: batching
must change how fast tokens come, never which tokens come. Rows joined and left in
place are tests/test_batch_rows.py; requests prefilled together, tests/test_batch_prefill.py.
"""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from shared.sizes import MiB
from tests.batch_harness import DTYPES, PROMPTS, load_tiny
from tests.batch_harness import Counting as _Counting
from tests.batch_harness import alone as _alone
from tests.batch_harness import staggered as _staggered
from tests.engine_harness import OPEN, Run, drive
from tests.engine_harness import engine_for as _engine
from worker.engine import Engine


@pytest.fixture(scope="module", params=DTYPES)
def loaded(request, tiny_model, tmp_path_factory):
    return load_tiny(request.param, tiny_model, tmp_path_factory)


def test_batched_greedy_output_is_token_identical_to_each_request_alone(loaded):
    """Five prompts of different lengths join at different steps and leave at different steps."""
    engine = _engine(loaded, max_chunk=8)
    prompts = {rid: engine.encode_prompt(text) for rid, text in PROMPTS.items()}
    lengths = {"a": 24, "b": 9, "c": 30, "d": 16, "e": 20}
    alone = {rid: _alone(engine, {rid: p}, lengths[rid])[rid] for rid, p in prompts.items()}
    run = _staggered(engine, prompts, {"a": 0, "b": 0, "c": 3, "d": 7, "e": 15}, lengths)
    for rid in prompts:
        assert isinstance(run.terminal(rid), Finished)
        assert run.tokens(rid) == alone[rid], rid
        assert len(alone[rid]) == lengths[rid]


def test_decoding_sequences_advance_in_one_forward_pass_per_step(loaded):
    model, tokenizer = loaded
    counting = _Counting(model)
    engine = Engine(counting, tokenizer, own_usage_fn=lambda: 0)
    rids = list(PROMPTS)[:4]
    for rid in rids:
        engine.submit(rid, engine.encode_prompt(PROMPTS[rid]), max_tokens=12)
    run = Run()
    while len(engine.decode.batch) < 4:
        run.add(engine.step(OPEN, lambda: 0))
    for _ in range(3):
        before = len(counting.batches)
        events = engine.step(OPEN, lambda: 0)
        run.add(events)
        assert counting.batches[before:] == [4], "one pass of all four rows per step"
        assert sorted(e.request_id for e in events if isinstance(e, TokenOut)) == sorted(rids)
    run.add(drive(engine).events)
    assert all(isinstance(run.terminal(rid), Finished) for rid in rids)


def test_unbatched_engine_gives_the_same_tokens(loaded):
    """The per-sequence path (kept for models whose KV cannot be batched) agrees with the batch."""
    batched, single = _engine(loaded), _engine(loaded, batch_decode=False)
    assert batched.batch_decode and not single.batch_decode
    runs = []
    for engine in (batched, single):
        for rid, text in PROMPTS.items():
            engine.submit(rid, engine.encode_prompt(text), max_tokens=10)
        runs.append(drive(engine))
    for rid in PROMPTS:
        assert runs[0].tokens(rid) == runs[1].tokens(rid)


def test_seeded_and_greedy_rows_keep_their_own_sampling_in_one_batch(loaded):
    engine = _engine(loaded)
    prompt = engine.encode_prompt(PROMPTS["a"])
    engine.submit("seeded", prompt, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    seeded_alone = drive(engine).tokens("seeded")
    greedy_alone = _alone(engine, {"greedy": prompt}, 12)["greedy"]
    engine.submit("noise", prompt, max_tokens=12, temperature=1.5)
    engine.submit("seeded", prompt, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    engine.submit("greedy", prompt, max_tokens=12)
    run = drive(engine)
    assert run.tokens("seeded") == seeded_alone
    assert run.tokens("greedy") == greedy_alone


def test_stop_string_ends_one_row_and_the_others_go_on(loaded):
    engine = _engine(loaded)
    prompts = {rid: engine.encode_prompt(PROMPTS[rid]) for rid in ("a", "b")}
    alone = _alone(engine, prompts, 20)
    engine.submit("a", prompts["a"], max_tokens=20)
    full = drive(engine).text("a")
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "the model's text is too short for a stop string"
    engine.submit("a", prompts["a"], max_tokens=20, stop=[stop])
    engine.submit("b", prompts["b"], max_tokens=20)
    run = drive(engine)
    end = run.terminal("a")
    assert isinstance(end, Finished) and end.finish_reason == "stop"
    assert run.text("a") == full[: full.index(stop)]
    assert run.tokens("b") == alone["b"]


def test_abort_between_steps_takes_one_row_out_and_the_rest_stay_identical(loaded):
    engine = _engine(loaded)
    prompts = {rid: engine.encode_prompt(PROMPTS[rid]) for rid in ("a", "b", "c")}
    alone = _alone(engine, prompts, 16)
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=16)
    run = Run()
    while len([e for e in run.events if isinstance(e, TokenOut) and e.request_id == "b"]) < 4:
        run.add(engine.step(OPEN, lambda: 0))
    assert engine.abort("b", "client went away")
    run.add(drive(engine).events)
    end = run.terminal("b")
    assert isinstance(end, Failed) and end.code == "aborted"
    assert run.tokens("a") == alone["a"] and run.tokens("c") == alone["c"]
    assert len(engine.decode.batch) == 0


def test_h1_a_sequence_leaving_the_batch_feeds_the_prompt_cache(loaded):
    """H1 with batching: the KV a row leaves with is extracted, cached and reused identically."""
    engine = _engine(loaded)
    cached = Limits(max_concurrency=8, cache_cap=64 * MiB)
    long = engine.encode_prompt(PROMPTS["d"])
    other = engine.encode_prompt(PROMPTS["b"])
    engine.submit("first", long, max_tokens=8)
    engine.submit("beside", other, max_tokens=14)
    first = drive(engine, cached)
    assert len(engine.prompt_cache) >= 1
    follow = long + first.tokens("first")[:-1] + engine.encode_prompt(" and then")[1:]
    engine.submit("again", follow, max_tokens=10)
    again = drive(engine, cached)
    end = again.terminal("again")
    assert end.cached_tokens >= len(long)
    fresh = _engine(loaded)
    fresh.submit("again", follow, max_tokens=10)
    assert again.tokens("again") == drive(fresh).tokens("again")


def test_engine_failure_in_a_batched_step_fails_every_row_and_the_engine_keeps_serving(loaded):
    model, tokenizer = loaded

    class Failing(_Counting):
        def __call__(self, inputs, *args, **kwargs):
            if inputs.shape[0] > 1:
                raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes.")
            return self.model(inputs, *args, **kwargs)

    engine = Engine(Failing(model), tokenizer, own_usage_fn=lambda: 0)
    for rid in ("a", "b"):
        engine.submit(rid, engine.encode_prompt(PROMPTS[rid]), max_tokens=6)
    run = drive(engine)
    assert all(isinstance(run.terminal(rid), Failed) for rid in ("a", "b"))
    engine.submit("after", engine.encode_prompt(PROMPTS["c"]), max_tokens=3)
    assert isinstance(drive(engine).terminal("after"), Finished)


# ------------------------------------------------------------------ the wire (TokenBatch)


def test_a_steps_tokens_leave_in_one_token_batch_before_each_requests_end():
    from shared import protocol as p

    events = [p.Failed(request_id="gone", code="aborted", message="x"),
              TokenOut(request_id="a", text="He", token_id=1), TokenOut(request_id="b", text="llo", token_id=2),
              Finished(request_id="b", finish_reason="stop", prompt_tokens=3, completion_tokens=4),
              TokenOut(request_id="c", text="!", token_id=3)]
    out = p.coalesce(events)
    assert [type(e).__name__ for e in out] == ["Failed", "TokenBatch", "Finished"]
    assert out[1].tokens() == [e for e in events if isinstance(e, TokenOut)]
    codec = p.Codec(p.WorkerReply)
    assert codec.decode(codec.encode(out[1])) == out[1]
    single = [TokenOut(request_id="a", text="x"), events[3]]
    assert p.coalesce(single) == single  # one token: no batch


def test_a_token_batch_with_columns_of_unequal_length_yields_no_tokens():
    from shared import protocol as p

    bad = p.TokenBatch(request_ids=["a", "b"], texts=["x"], token_ids=[1, 2])
    assert bad.tokens() == []


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_sse_token_chunk_is_byte_identical_to_the_full_chunk(kind, include_usage):
    """The per-token SSE chunk is encoded from a per-request frame, never differently."""
    from shared import protocol as p
    from supervisor.http.job import Job
    from supervisor.http.openai import Completion

    job = Job(None, None, "m", p.Generate(prompt="x", request_id="r1"), 0.0, None)  # type: ignore[arg-type]
    reply = Completion(job, kind, include_usage)
    for text in ["hello", ' "quoted"\n', "ünï\u2028", "\x00memvisor-token", "\\"]:
        assert reply.token_chunk(text) == reply.chunk(text)


def test_h3_pinned_bytes_kept_up_to_date_equal_the_sum_over_pinned_entries():
    """The batch reads `releasable` once a decode step, so it is kept, not summed; it must not drift."""
    import random

    from tests.prompt_cache_harness import kv
    from worker.prompt_cache import PromptCache

    rng = random.Random(3)
    cache = PromptCache(6 * 2 * 2 * 4 * 64 * 4, min_reuse=1)
    hits = []
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            n = rng.randrange(2, 12)
            tokens = [rng.randrange(3) for _ in range(n)]
            cache.insert(tokens, kv(n))
        elif op < 0.7:
            hit = cache.lookup([rng.randrange(3) for _ in range(12)], 11)
            if hit is not None:
                hits.append(hit)
        elif op < 0.9 and hits:
            cache.release(hits.pop(rng.randrange(len(hits))))
        else:
            cache.drop_lru(rng.randrange(0, cache.cap))
        assert cache.pinned_bytes == sum(e.nbytes for e in cache._entries.values() if e.pins)
        assert cache.releasable == cache.nbytes - cache.pinned_bytes >= 0


def test_constrained_rows_join_the_batch_and_every_row_matches_its_request_alone(loaded):
    """A grammar row samples after its mask, in the same batched pass as the rest."""
    import json

    from shared import protocol as p

    model, tokenizer = loaded
    counting = _Counting(model)
    engine = Engine(counting, tokenizer, own_usage_fn=lambda: 0)
    spec = p.JsonSchema(schema=json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                           "required": ["name"]}))
    prompts = {rid: engine.encode_prompt(PROMPTS[rid]) for rid in ("a", "b", "c")}
    asks = {"a": {}, "b": {"constraint": spec}, "c": {"constraint": p.JsonObject(), "temperature": 1.0, "seed": 5}}
    alone = {}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=24, **asks[rid])
        alone[rid] = drive(engine).tokens(rid)
    counting.batches.clear()
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=24, **asks[rid])
    run = drive(engine)
    for rid in prompts:
        assert isinstance(run.terminal(rid), Finished)
        assert run.tokens(rid) == alone[rid], rid
    assert 3 in counting.batches, "the constrained rows never shared a pass with the free one"
