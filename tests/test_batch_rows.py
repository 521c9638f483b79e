"""The decode batch's rows joined and left in place, on real tiny models (CPU, float16 and
float32): a join or a leave copies the rows that move, never the running batch; the buffers
grow, shrink and move their window, and every stream stays token-identical to its request alone.
"""

from __future__ import annotations

import pytest

from shared.protocol import Finished
from tests.batch_harness import DTYPES, PROMPTS, load_tiny
from tests.batch_harness import alone as _alone
from tests.batch_harness import staggered as _staggered
from tests.engine_harness import engine_for as _engine
from worker.batch import Growth


@pytest.fixture(scope="module", params=DTYPES)
def loaded(request, tiny_model, tmp_path_factory):
    return load_tiny(request.param, tiny_model, tmp_path_factory)


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
