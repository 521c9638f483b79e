"""Batched decode in the engine, on real tiny models (CPU, float16 and float32).

Every test here compares against what the same request gives alone: batching
must change how fast tokens come, never which tokens come.
"""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from shared.sizes import GiB, MiB
from tests.engine_harness import OPEN, Run, drive
from worker.batch import Growth
from worker.engine import Engine

PROMPTS = {  # different lengths, so rows are left-padded differently
    "a": "Once upon a time",
    "b": "The memory guard watches every model and steps in early, before the machine swaps.",
    "c": "def main():",
    "d": "A worker holds one model; the supervisor holds the workers and the memory they may use. "
         "When a prompt is long, its prefill is cut into chunks.",
    "e": "x",
}


@pytest.fixture(scope="module", params=["float16", "float32"])
def loaded(request, tiny_model, tmp_path_factory):
    import mlx_lm

    if request.param == "float16":
        return mlx_lm.load(str(tiny_model))
    from modelfiles.modelgen import make_model

    path = tmp_path_factory.mktemp("f32") / "tiny-f32"
    make_model(path, 4 * MiB, 5, dtype="float32")
    return mlx_lm.load(str(path))


class _Counting:
    """The real model, counting forward passes and the batch size of each."""

    def __init__(self, model):
        self.model = model
        self.batches: list[int] = []

    def __call__(self, inputs, *args, **kwargs):
        self.batches.append(inputs.shape[0])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _engine(loaded, **kwargs) -> Engine:
    model, tokenizer = loaded
    kwargs.setdefault("own_usage_fn", lambda: 0)
    return Engine(model, tokenizer, **kwargs)


def _alone(engine: Engine, prompts: dict[str, list[int]], max_tokens: int, **sampling) -> dict[str, list[int]]:
    out = {}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=max_tokens, **sampling)
        out[rid] = drive(engine).tokens(rid)
    return out


def _staggered(engine: Engine, prompts: dict[str, list[int]], joins: dict[str, int], max_tokens,
               **sampling) -> Run:
    """Submit each request at its step (so it joins a batch already decoding), drive to the end."""
    run = Run()
    for step in range(4000):
        for rid, at in joins.items():
            if at == step:
                tokens = max_tokens[rid] if isinstance(max_tokens, dict) else max_tokens
                engine.submit(rid, prompts[rid], max_tokens=tokens, **sampling)
        if step > max(joins.values()) and not engine.has_work:
            return run
        run.add(engine.step(OPEN, lambda: 0))
    raise AssertionError("engine still busy")


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


# ------------------------------------------------------------------ rows joined and left in place


def _kv(length: int, seed: int, layers: int = 3, heads: int = 4, dim: int = 32) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in range(layers):
        cache = KVCache()
        key = mx.random.key(seed * 100 + layer)
        cache.update_and_fetch(mx.random.normal((1, heads, length, dim), key=key),
                               mx.random.normal((1, heads, length, dim), key=mx.random.split(key)[0]))
        out.append(cache)
    mx.eval([(c.keys, c.values) for c in out])
    return out


class _Row:
    sample = None


def test_join_and_leave_copy_the_rows_that_move_never_the_running_batch():
    """`BatchKVCache.extend`/`filter` copied the whole batch's KV on every join and leave.

    A newcomer is written into a free row and a leaver's hole is filled by
    the last row: the peak of either is a row's worth, far under one layer of
    the batch; every row still holds exactly its own KV afterwards.
    """
    import mlx.core as mx

    from worker.batch import DecodeBatch

    batch = DecodeBatch(max_rows=64)
    rows = [_Row() for _ in range(20)]
    kvs = {i: _kv(40 + 9 * (i % 16), i) for i in range(20)}  # newcomers fit the room in front
    for i in range(16):
        batch.join([rows[i]], [kvs[i]], [mx.array([i])])
    batch.keep([i for i in range(len(batch)) if i not in (2, 5, 9)], batch.y)  # free rows to reuse
    one_layer = batch.nbytes // len(batch.layers)
    relayouts = batch.relayouts
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    batch.join([rows[16], rows[17]], [kvs[16], kvs[17]], [mx.array([16]), mx.array([17])])
    mx.eval([(layer.keys, layer.values) for layer in batch.layers])
    join_peak = mx.get_peak_memory() - before
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    batch.keep([i for i in range(len(batch)) if i not in (0, 7)], batch.y)
    mx.eval([(layer.keys, layer.values) for layer in batch.layers])
    leave_peak = mx.get_peak_memory() - before
    assert batch.relayouts == relayouts, "joining free rows must not grow the buffers"
    assert join_peak < one_layer / 4, (join_peak, one_layer)
    assert leave_peak < one_layer / 4, (leave_peak, one_layer)
    for slot, row in enumerate(batch.rows):
        mine = kvs[rows.index(row)]
        for layer, theirs in zip(batch.extract([slot])[0], mine):
            assert mx.array_equal(layer.keys, theirs.keys[..., :theirs.offset, :]).item()
            assert mx.array_equal(layer.values, theirs.values[..., :theirs.offset, :]).item()
    assert sorted(batch.tokens()) == sorted(rows.index(row) for row in batch.rows)


def test_buffers_shrink_to_the_live_rows_when_most_leave_and_live_bytes_count_their_tokens():
    """Rows leaving left their buffers behind until the batch emptied (3-4x the live
    KV): once the buffers hold more than twice what the rows that stay fit in, those rows move
    into buffers that fit them. `live_nbytes` is the rows' own tokens, padding and room excluded."""
    import mlx.core as mx

    from worker.batch import DecodeBatch

    batch = DecodeBatch(max_rows=64)
    rows = [_Row() for _ in range(12)]
    kvs = [_kv(20 + 30 * i, i) for i in range(12)]
    batch.join(rows, kvs, [mx.array([i]) for i in range(12)])
    per_token = sum(c.keys.nbytes + c.values.nbytes for c in kvs[0]) // kvs[0][0].keys.shape[2]
    assert batch.live_nbytes == per_token * sum(20 + 30 * i for i in range(12))
    full, relayouts = batch.nbytes, batch.relayouts
    batch.keep([0, 3], batch.y)  # the two shortest stay: their window is far shorter too
    assert batch.relayouts == relayouts + 1 and batch.capacity == 2
    assert batch.length < 2 * 110 and batch.nbytes < full / 8  # two rows, the longer one's window and room
    assert batch.rows == [rows[0], rows[3]] and batch.tokens() == [0, 3]
    for slot, i in enumerate((0, 3)):
        for layer, theirs in zip(batch.extract([slot])[0], kvs[i]):
            assert mx.array_equal(layer.keys, theirs.keys[..., :theirs.offset, :]).item()
            assert mx.array_equal(layer.values, theirs.values[..., :theirs.offset, :]).item()


def test_greedy_output_stays_identical_when_the_buffers_shrink(loaded):
    """Requests leave at different steps, so the buffers shrink under the ones that go on."""
    engine = _engine(loaded, max_chunk=8)
    engine.decode.batch.growth = Growth(step=4)
    prompts = {rid: engine.encode_prompt(PROMPTS[rid]) for rid in PROMPTS}
    lengths = {"a": 3, "b": 4, "c": 30, "d": 5, "e": 6}
    alone = {rid: _alone(engine, {rid: p}, lengths[rid])[rid] for rid, p in prompts.items()}
    shrunk = []
    batch = engine.decode.batch
    keep = batch.keep

    def watch(indices, y):
        before = batch.capacity
        keep(indices, y)
        if indices and batch.capacity < before:
            shrunk.append((before, batch.capacity))

    batch.keep = watch
    run = _staggered(engine, prompts, {rid: 0 for rid in prompts}, lengths)
    assert shrunk, "the buffers never shrank"
    assert {rid: run.tokens(rid) for rid in prompts} == alone


def test_greedy_output_is_identical_through_joins_leaves_and_buffer_growth(loaded):
    """Eight requests of different lengths join and leave at different steps while the rows are
    full (capacity grows), a newcomer is longer than the room in front (the front grows) and the
    positions run out (the window moves): every stream is token-identical to its request alone."""
    engine = _engine(loaded, max_chunk=8)
    engine.decode.batch.growth = Growth(step=4, tail=3, rows=2, shrink_at=0)  # grow often: every kind of relayout happens in a short run
    texts = list(PROMPTS.values())
    prompts = {f"r{i}": engine.encode_prompt(texts[i % 5] + " " + texts[(i * 3) % 5][: 2 + 5 * i])
               for i in range(8)}
    lengths = {rid: 6 + (5 * i) % 23 for i, rid in enumerate(prompts)}
    alone = {rid: _alone(engine, {rid: p}, lengths[rid])[rid] for rid, p in prompts.items()}
    relayouts = engine.decode.batch.relayouts
    joins = {rid: 3 * i + (i % 3) for i, rid in enumerate(prompts)}
    run = _staggered(engine, prompts, joins, lengths)
    for rid in prompts:
        assert isinstance(run.terminal(rid), Finished)
        assert run.tokens(rid) == alone[rid], rid
    assert engine.decode.batch.relayouts - relayouts >= 3, "the run never grew the buffers"


def test_positions_running_out_after_the_longest_row_left_keep_every_row_identical(loaded):
    """The longest row leaves first, so the window's start moves far up; then the positions
    run out in the forward pass itself (no join or leave around it) and the buffers are laid
    out again: every layer's window start must move with the rows, or they attend to zeros
    and miss their own first tokens. (A first cut kept the old start there.)"""
    engine = _engine(loaded, max_chunk=8)
    engine.decode.batch.growth = Growth(step=4, shrink_at=0)  # no compaction: it would re-sync the layers
    prompts = {rid: engine.encode_prompt(PROMPTS[rid]) for rid in ("d", "c", "e")}
    lengths = {"d": 3, "c": 40, "e": 36}
    alone = {rid: _alone(engine, {rid: p}, lengths[rid])[rid] for rid, p in prompts.items()}
    relayouts = engine.decode.batch.relayouts
    run = _staggered(engine, prompts, {"d": 0, "c": 0, "e": 0}, lengths)
    assert engine.decode.batch.relayouts - relayouts >= 3, "the positions never ran out"
    assert {rid: run.tokens(rid) for rid in prompts} == alone


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

