"""The worker's prompt cache (SPEC H1-H4): the structure alone, then inside the engine on a real tiny model."""

from __future__ import annotations

import mlx.core as mx

from shared.limits import Limits
from shared.protocol import ChatMessage, Finished, Generate, NeedMemory
from shared.sizes import GiB, MiB
from tests.engine_harness import Run, drive, engine_for
from tests.prompt_cache_harness import kv
from worker.engine import Engine
from worker.prefill_guard import admission_peak, padded_chunk_bytes
from worker.prompt_cache import PromptCache

ENTRY = sum(c.nbytes for c in kv(10))  # one entry of < 256 tokens: one KV step per layer


def tokens(cache: PromptCache) -> list[tuple[int, ...]]:
    """The token sequences the cache holds, least recently used first."""
    return [entry.tokens for entry in reversed(cache.recent_first())]


def test_h2_entry_bytes_are_the_arrays_it_holds():
    cache = PromptCache(GiB)
    layers = kv(10)
    assert cache.insert(list(range(10)), layers)
    assert cache.nbytes == sum(c.keys.nbytes + c.values.nbytes for c in layers) == ENTRY


def test_h1_longest_prefix_wins_and_never_reaches_the_limit():
    cache = PromptCache(GiB)
    cache.insert([1, 2, 3], kv(3))
    cache.insert([1, 2, 9, 9, 9], kv(5))
    cache.insert([7, 7, 7, 7, 7, 7], kv(6))
    hit = cache.lookup([1, 2, 9, 9, 4, 4], limit=5)
    assert hit.entry.tokens == (1, 2, 9, 9, 9) and hit.tokens == 4
    assert cache.lookup([7, 7, 7, 7], limit=3).tokens == 3  # the last token is always run
    assert cache.lookup([5, 5], limit=1) is None


def test_h1_a_fork_never_writes_into_the_cached_arrays():
    cache = PromptCache(GiB)
    cache.insert(list(range(8)), kv(8, fill=1.0))
    hit = cache.lookup(list(range(8)) + [99], limit=8)
    fork = PromptCache.fork(hit)
    for layer in fork:
        new = mx.full((1, 2, 300, 4), 5.0)  # past the room: the KV grows by concatenation
        layer.update_and_fetch(new, new)
        layer.update_and_fetch(new[:, :, :1], new[:, :, :1])
    mx.eval([(c.keys, c.values) for c in fork])
    for layer in hit.entry.layers:
        assert layer.offset == 8
        assert mx.all(layer.keys[..., :8, :] == 1.0).item()
    assert fork[0].offset == 8 + 301
    assert mx.all(fork[0].keys[..., :8, :] == 1.0).item()


def test_insert_replaces_the_unpinned_prefixes_it_covers():
    cache = PromptCache(GiB)
    cache.insert([1, 2], kv(2))
    pinned = cache.lookup([3, 4, 0], limit=2)  # pins nothing yet: no entry
    assert pinned is None
    cache.insert([3, 4], kv(2))
    hit = cache.lookup([3, 4, 0], limit=2)
    cache.insert([1, 2, 5, 6], kv(4))
    cache.insert([3, 4, 5, 6], kv(4))
    assert sorted(tokens(cache)) == [(1, 2, 5, 6), (3, 4), (3, 4, 5, 6)]
    cache.release(hit)
    assert cache.nbytes == 3 * ENTRY


def test_h2_over_the_cap_least_recently_used_goes_first():
    cache = PromptCache(2 * ENTRY)
    cache.insert([1], kv(1))
    cache.insert([2], kv(1))
    cache.release(cache.lookup([1, 0], limit=1))  # [1] is now the most recently used
    cache.insert([3], kv(1))
    assert set(tokens(cache)) == {(1,), (3,)}
    assert cache.nbytes == 2 * ENTRY
    assert cache.set_cap(ENTRY) == ENTRY and set(tokens(cache)) == {(3,)}


def test_h2_cap_zero_is_no_prompt_cache():
    cache = PromptCache(0)
    assert not cache.insert([1, 2], kv(2))
    assert cache.lookup([1, 2, 3], limit=2) is None and cache.nbytes == 0


def test_h3_shrink_never_drops_an_entry_in_use():
    cache = PromptCache(GiB)
    cache.insert([1, 1], kv(2))
    cache.insert([2, 2], kv(2))
    hit = cache.lookup([1, 1, 5], limit=2)
    assert cache.releasable == ENTRY
    assert cache.drop_lru(0) == ENTRY
    assert set(tokens(cache)) == {(1, 1)} and cache.nbytes == ENTRY and cache.releasable == 0
    cache.release(hit)
    assert cache.drop_unused() == ENTRY and cache.nbytes == 0


# ------------------------------------------------------------------ in the engine

CACHED = Limits(max_concurrency=8, cache_cap=GiB)
UNCACHED = Limits(max_concurrency=8, cache_cap=0)


def _engine(loaded, **kwargs) -> Engine:
    kwargs.setdefault("max_chunk", 64)  # several chunks per prompt, as real prompts have
    return engine_for(loaded, **kwargs)


def _chat(engine: Engine, limits: Limits, turns: int) -> list[tuple[list[int], Finished]]:
    """A chat whose history grows each turn, the assistant's replies fed back as text."""
    messages = [ChatMessage(role="system", content="You are a careful assistant. " * 20)]
    out = []
    for turn in range(turns):
        messages.append(ChatMessage(role="user", content=f"Question {turn}: tell me more. " * 4))
        engine.submit_generate(Generate(request_id=f"t{turn}", messages=messages, max_tokens=12))
        run = drive(engine, limits)
        end = run.terminal(f"t{turn}")
        assert isinstance(end, Finished)
        out.append((run.tokens(f"t{turn}"), end))
        messages.append(ChatMessage(role="assistant", content=run.text(f"t{turn}")))
    return out


def test_h1_reuse_is_token_identical_and_reports_cached_tokens(loaded):
    plain = _chat(_engine(loaded), UNCACHED, 4)
    engine = _engine(loaded)
    cached = _chat(engine, CACHED, 4)
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in plain]
    assert all(end.cached_tokens == 0 for _, end in plain)
    assert cached[0][1].cached_tokens == 0
    for (_, before), (_, end) in zip(cached, cached[1:]):
        # all of the previous prompt but the tail of its generation prompt, which the
        # template writes differently once the assistant's reply follows it
        assert before.prompt_tokens - 4 <= end.cached_tokens < end.prompt_tokens
    assert engine.cache_bytes > 0 and engine.cache_releasable == engine.cache_bytes


def test_h1_only_the_new_tokens_are_prefilled(loaded):
    engine = _engine(loaded)
    prompt = engine.encode_prompt("a long shared beginning " * 20)
    engine.submit("a", prompt, max_tokens=4)
    drive(engine, CACHED)
    before = engine.prompt_tokens_processed
    engine.submit("b", prompt + prompt[1:6], max_tokens=4)
    end = drive(engine, CACHED).terminal("b")
    assert end.cached_tokens == len(prompt)
    assert engine.prompt_tokens_processed - before == 5


def test_h2_over_its_cap_the_engine_drops_lru_at_the_next_step(loaded):
    engine = _engine(loaded)
    prompts = [engine.encode_prompt(word * 30) for word in ("alpha ", "beta ", "gamma ")]
    for i, prompt in enumerate(prompts):
        engine.submit(f"r{i}", prompt, max_tokens=3)
        drive(engine, CACHED)
    assert len(engine.prompt_cache) == 3
    cap = engine.cache_bytes - 1
    engine.step(Limits(max_concurrency=8, cache_cap=cap), lambda: 0)
    kept = [key[:len(prompts[0])] for key in tokens(engine.prompt_cache)]
    assert engine.cache_bytes <= cap and len(kept) == 2
    assert tuple(prompts[0]) not in kept  # the least recently used went


def test_h3_shrink_spares_the_entry_a_queued_request_will_reuse(loaded):
    engine = _engine(loaded)
    shared = engine.encode_prompt("the system prompt everybody shares " * 10)
    engine.submit("first", shared, max_tokens=3)
    engine.submit("other", engine.encode_prompt("unrelated words " * 10), max_tokens=3)
    drive(engine, CACHED)
    engine.submit("again", shared + shared[1:4], max_tokens=3)  # queued, not stepped yet
    in_use = engine.cache_bytes - engine.cache_releasable
    assert in_use > 0
    assert engine.shrink_cache(0) > 0
    assert engine.cache_bytes == in_use
    end = drive(engine, CACHED).terminal("again")
    assert end.cached_tokens >= len(shared)


def test_h4_prefill_drops_own_unused_entries_before_asking_for_room(loaded):
    reclaims = []
    engine = _engine(loaded, reclaim_fn=lambda: reclaims.append(1) or 0)
    engine.submit("old", engine.encode_prompt("an old conversation " * 40), max_tokens=3)
    drive(engine, CACHED)
    held = engine.cache_bytes
    assert held > 0
    # The group is full only by what our own cache holds: dropping it makes room.
    limits = Limits(max_concurrency=8, cache_cap=GiB, hard_limit=64 * MiB, soft_limit=60 * MiB,
                    hard_watermark=62 * MiB, abort_limit=64 * MiB, abort_margin=1.0,
                    min_chunk_tokens=16, static=64 * MiB)
    prompt = engine.encode_prompt("something else entirely")
    peak = admission_peak(len(prompt), engine.cost, limits.min_chunk_tokens)  # what G1 compares
    base = 64 * MiB - peak - held // 2  # fits without our cache, not with it
    engine.submit("new", prompt, max_tokens=3)
    run = drive(engine, limits, usage_fn=lambda: base + engine.cache_bytes)
    assert not any(isinstance(ev, NeedMemory) for ev in run.events)
    assert isinstance(run.terminal("new"), Finished)
    assert reclaims  # the dropped entries' memory went back to the OS, not only to the pool
    assert [key[:len(prompt)] for key in tokens(engine.prompt_cache)] == [tuple(prompt)]


def test_h4_a_floor_chunk_short_of_room_drops_own_unused_entries_before_asking(loaded):
    """G2 (2026-12-05) takes H4's order too: G1 lets the prompt in, its floor chunk fits the chunk
    target only without this worker's own unused entries, so they go and nobody is asked."""
    reclaims = []
    engine = _engine(loaded, reclaim_fn=lambda: reclaims.append(1) or 0)
    engine.submit("old", engine.encode_prompt("an old conversation " * 40), max_tokens=3)
    drive(engine, CACHED)
    held = engine.cache_bytes
    limits = Limits(max_concurrency=8, cache_cap=GiB, hard_limit=64 * MiB, soft_limit=60 * MiB,
                    hard_watermark=62 * MiB, abort_limit=64 * MiB, abort_margin=1.0,
                    prefill_headroom_safety=0.9, min_chunk_tokens=16, static=64 * MiB)
    prompt = engine.encode_prompt("something else entirely")
    floor = padded_chunk_bytes(engine.cost, 0, len(prompt) - 1)  # the whole prompt is one floor chunk
    target = int(64 * MiB * 0.9)
    base = target - floor - held // 2  # the floor chunk fits without our cache, not with it
    assert 0 < held and base + held + admission_peak(len(prompt), engine.cost, 16) <= 64 * MiB  # G1 fits
    engine.submit("new", prompt, max_tokens=3)
    run = drive(engine, limits, usage_fn=lambda: base + engine.cache_bytes)
    assert not any(isinstance(ev, NeedMemory) for ev in run.events)
    assert isinstance(run.terminal("new"), Finished)
    assert reclaims  # the dropped entries' memory went back to the OS, not only to the pool


def test_h3_a_running_request_reads_its_own_copy_so_its_source_entry_may_go(loaded):
    prompt = _engine(loaded).encode_prompt("the prompt both requests start with " * 10)
    plain = _engine(loaded)
    plain.submit("b", prompt + prompt[1:8], max_tokens=8)
    expected = drive(plain, UNCACHED).tokens("b")
    engine = _engine(loaded)
    engine.submit("a", prompt, max_tokens=3)
    drive(engine, CACHED)
    engine.submit("b", prompt + prompt[1:8], max_tokens=8)
    run = Run()
    while not engine.scheduler.decoding:  # prefilled from the cache, now decoding
        run.add(engine.step(CACHED, lambda: 0))
    assert engine.running == 1 and engine.cache_releasable == engine.cache_bytes > 0
    assert engine.shrink_cache(0) > 0 and engine.cache_bytes == 0
    run.add(drive(engine, CACHED).events)
    assert run.terminal("b").cached_tokens == len(prompt) and run.tokens("b") == expected


def test_h1_a_burst_of_wholly_cached_prompts_decodes_at_once_token_identical(loaded):
    """Requests whose whole prompt but the last token is cached take no prefill pass of their
    own: their last prompt tokens ride in one decode pass, so all of them get their first
    token in the same step, and greedy output stays what the prompt gives alone."""
    engine = _engine(loaded)
    prompt = engine.encode_prompt("the same question again " * 8)
    engine.submit("first", prompt, max_tokens=6)
    alone = drive(engine, CACHED).tokens("first")
    before = engine.prompt_tokens_processed
    burst = [f"again{i}" for i in range(5)]
    for rid in burst:
        engine.submit(rid, list(prompt), max_tokens=6)
    run = Run()
    first_step: dict[str, int] = {}
    for step in range(200):
        if not engine.has_work:
            break
        events = engine.step(CACHED, lambda: 0)
        run.add(events)
        for ev in events:
            if getattr(ev, "token_id", -1) >= 0:
                first_step.setdefault(ev.request_id, step)
    for rid in burst:
        end = run.terminal(rid)
        assert isinstance(end, Finished) and end.cached_tokens == len(prompt) - 1
        assert run.tokens(rid) == alone
    assert engine.prompt_tokens_processed - before == len(burst)  # one token each: the last
    assert len(set(first_step.values())) == 1, first_step


def test_h1_a_wholly_cached_prompt_with_max_tokens_one_still_gets_its_token(loaded):
    engine = _engine(loaded)
    prompt = engine.encode_prompt("one more time " * 8)
    engine.submit("a", prompt, max_tokens=3)
    want = drive(engine, CACHED).tokens("a")[:1]
    engine.submit("b", list(prompt), max_tokens=1)
    run = drive(engine, CACHED)
    end = run.terminal("b")
    assert isinstance(end, Finished) and end.finish_reason == "length" and end.cached_tokens == len(prompt) - 1
    assert run.tokens("b") == want
