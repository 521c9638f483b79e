"""The worker's MLX engine on real tiny models (CPU): generation, scheduling, SPEC P3/P8, stop
strings, prefill chunks by time, the context limit and the warm-up. What ends a request early is
tests/test_engine_failures.py; the prefill guard in the engine (G1-G3), tests/test_g_engine.py."""

from __future__ import annotations

import mlx.core as mx

from shared.limits import Limits
from shared.protocol import ChatMessage, Failed, Finished, Generate, NeedMemory, TokenOut
from shared.sizes import GiB
from tests.engine_harness import GUARDED, OPEN, Run, drive, engine_for
from tests.engine_harness import prompt_tokens as _prompt
from worker.engine import Engine
from worker.stops import StopMatcher

# ------------------------------------------------------------------ generation


def test_generates_exactly_max_tokens_and_streams_the_decoded_text(loaded):
    engine = engine_for(loaded)
    engine.submit("r", _prompt(engine), max_tokens=12)
    run = drive(engine)
    end = run.terminal("r")
    assert isinstance(end, Finished)
    assert (end.finish_reason, end.completion_tokens) == ("length", 12)
    assert end.prompt_tokens == len(_prompt(engine))
    tokens = run.tokens("r")
    assert len(tokens) == 12
    # mlx_lm's byte-level detokenizer drops the one space a reply starts with; so do we.
    decoded = loaded[1].decode(tokens)
    assert run.text("r") == (decoded[1:] if decoded.startswith(" ") else decoded)
    assert engine.tokens_total == 12


def test_greedy_tokens_match_plain_mlx_lm(loaded):
    """The engine's chunked prefill and pipelined decode must not change what the model says."""
    from mlx_lm.generate import generate_step

    model, _ = loaded
    engine = engine_for(loaded, max_chunk=4)  # several prefill chunks
    prompt = _prompt(engine, "The memory guard watches every model and steps in early.")
    expected = [tok for tok, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    engine.submit("r", prompt, max_tokens=16)
    assert drive(engine).tokens("r") == expected


def test_stop_sequence_ends_generation_and_is_not_emitted(loaded):
    engine = engine_for(loaded)
    engine.submit("free", _prompt(engine), max_tokens=24)
    full = drive(engine).text("free")
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    engine.submit("stopped", _prompt(engine), max_tokens=24, stop=[stop])
    run = drive(engine)
    end = run.terminal("stopped")
    assert end.finish_reason == "stop"
    assert run.text("stopped") == full[: full.index(stop)]
    assert end.completion_tokens < 24


def test_eos_token_finishes_with_stop_and_is_not_text(tiny_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model))
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0)
    engine.submit("probe", _prompt(engine), max_tokens=6)
    tokens = drive(engine).tokens("probe")
    eos = tokens[3]
    tokenizer.eos_token_ids = {eos}
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0)
    engine.submit("r", _prompt(engine), max_tokens=6)
    run = drive(engine)
    end = run.terminal("r")
    first = tokens.index(eos)
    assert (end.finish_reason, end.completion_tokens) == ("stop", first + 1)
    assert run.tokens("r") == tokens[:first]
    assert run.text("r") == tokenizer.decode(tokens[:first]).removeprefix(" ")


def test_chat_messages_go_through_the_chat_template(loaded):
    engine = engine_for(loaded)
    messages = [ChatMessage(role="user", content="Say hello")]
    expected = loaded[1].apply_chat_template([{"role": "user", "content": "Say hello"}],
                                             add_generation_prompt=True)
    assert engine.encode_chat(messages) == list(expected)
    engine.submit_generate(Generate(request_id="chat", messages=messages, max_tokens=3))
    end = drive(engine).terminal("chat")
    assert end.prompt_tokens == len(expected)
    text = loaded[1].decode(expected)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nSay hello" in text


def test_completion_prompt_gets_bos_once(loaded):
    engine = engine_for(loaded)
    bos = loaded[1].bos_token_id
    assert engine.encode_prompt("hi")[0] == bos
    assert engine.encode_prompt("<s>hi").count(bos) == 1


def test_seeded_sampling_repeats_whatever_runs_beside_it(loaded):
    engine = engine_for(loaded)
    prompt = _prompt(engine)
    engine.submit("alone", prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    alone = drive(engine).tokens("alone")
    engine.submit("noise", prompt, max_tokens=10, temperature=1.0)
    engine.submit("again", prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    engine.submit("other", prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=43)
    run = drive(engine)
    assert run.tokens("again") == alone
    assert run.tokens("other") != alone


def test_negative_seed_samples_as_its_64_bit_twos_complement(loaded):
    """OpenAI seeds are int64; MLX keys take uint64 only. A negative seed used to
    raise TypeError inside the worker's command loop and kill the worker, failing
    every stream on it (and, repeated, marking a pinned model failed)."""
    engine = engine_for(loaded)
    prompt = _prompt(engine)
    engine.submit("neg", prompt, max_tokens=6, temperature=1.0, seed=-1)
    engine.submit("max", prompt, max_tokens=6, temperature=1.0, seed=2**64 - 1)
    run = drive(engine)
    assert isinstance(run.terminal("neg"), Finished) and isinstance(run.terminal("max"), Finished)
    assert run.tokens("neg") == run.tokens("max")


# ------------------------------------------------------------------ scheduling


def test_two_sequences_interleave_with_their_own_kv_caches(loaded):
    engine = engine_for(loaded)
    p1, p2 = _prompt(engine, "Once upon a time"), _prompt(engine, "def main():")
    solo = {}
    for rid, prompt in (("one", p1), ("two", p2)):
        engine.submit(rid, prompt, max_tokens=10)
        solo[rid] = drive(engine).tokens(rid)
    engine.submit("one", p1, max_tokens=10)
    engine.submit("two", p2, max_tokens=10)
    run = drive(engine)
    assert run.tokens("one") == solo["one"] and run.tokens("two") == solo["two"]
    order = [ev.request_id for ev in run.events if isinstance(ev, TokenOut)]
    first_end = min(i for i, ev in enumerate(run.events) if isinstance(ev, Finished))
    assert {"one", "two"} <= set(order[:first_end]), "tokens did not interleave"


def test_p8_concurrency_cap_is_respected(loaded):
    engine = engine_for(loaded)
    for i in range(3):
        engine.submit(f"r{i}", _prompt(engine), max_tokens=5)
    limits = Limits(max_concurrency=2)
    peak_running = 0
    run = Run()
    while engine.has_work:
        run.add(engine.step(limits, lambda: 0))
        peak_running = max(peak_running, engine.running)
        assert engine.running + engine.queued + sum(
            isinstance(ev, (Finished, Failed)) for ev in run.events) == 3
    assert peak_running == 2
    r2_first = next(i for i, ev in enumerate(run.events) if ev.request_id == "r2")
    first_end = min(i for i, ev in enumerate(run.events) if isinstance(ev, Finished))
    assert r2_first > first_end, "third request started before a slot was free"


def test_engine_max_concurrency_caps_even_generous_limits(loaded):
    engine = engine_for(loaded, max_concurrency=1)
    engine.submit("a", _prompt(engine), max_tokens=3)
    engine.submit("b", _prompt(engine), max_tokens=3)
    engine.step(Limits(max_concurrency=8), lambda: 0)
    assert (engine.running, engine.queued) == (1, 1)


def test_p3_paused_admission_takes_one_when_idle_and_none_beside_a_running_one(loaded):
    """Pressure pauses new work, but a worker with nothing running still takes one request,
    so pressure never starves everyone (SPEC P3)."""
    engine = engine_for(loaded, speculative=False)  # one token a step: the one running still runs after 3
    paused = Limits(max_concurrency=4, admission_paused=True)
    for i in range(3):
        engine.submit(f"r{i}", _prompt(engine), max_tokens=4)
    engine.step(paused, lambda: 0)
    assert (engine.running, engine.queued) == (1, 2)
    for _ in range(3):
        engine.step(paused, lambda: 0)
        assert engine.running == 1
    engine.step(Limits(max_concurrency=4), lambda: 0)
    assert (engine.running, engine.queued) == (3, 0)
    drive(engine)


def test_prefill_chunks_alternate_with_decode_steps(loaded):
    """A long prompt arriving must not freeze streams already running."""
    engine = engine_for(loaded, max_chunk=8)
    engine.submit("running", _prompt(engine), max_tokens=40)
    while not engine.tokens_total:
        engine.step(OPEN, lambda: 0)
    long_prompt = _prompt(engine, "word " * 60)
    engine.submit("long", long_prompt, max_tokens=2)
    run = Run()
    while not any(isinstance(ev, TokenOut) for ev in run.by_id["long"]):  # its first token (Prompted comes earlier)
        run.add(engine.step(OPEN, lambda: 0))
    tokens_during_prefill = len(run.tokens("running"))
    chunks = -(-(len(long_prompt) - 1) // 8)
    assert tokens_during_prefill >= chunks - 1
    drive(engine)


# ------------------------------------------------------------------ stop matcher


def test_stop_matcher_holds_a_stop_split_across_tokens():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello S") == ("hello ", False)
    assert matcher.feed("TO") == ("", False)
    assert matcher.feed("P and more") == ("", True)


def test_stop_matcher_releases_held_text_when_it_was_not_a_stop():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ay") == ("STay", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_stop_matcher_picks_the_earliest_of_several_stops():
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", True)


def test_memory_counters_track_running_queued_tokens(loaded):
    """The figures the worker writes into every sample (running, queued, tokens)."""
    engine = engine_for(loaded)
    engine.submit("a", _prompt(engine), max_tokens=4)
    engine.submit("b", _prompt(engine), max_tokens=4)
    assert (engine.running, engine.queued, engine.tokens_total) == (0, 2, 0)
    engine.step(Limits(max_concurrency=1), lambda: 0)
    assert (engine.running, engine.queued) == (1, 1)
    drive(engine)
    assert engine.tokens_total == 8


def test_idle_while_the_head_waits_for_memory_even_with_more_queued(loaded):
    """No busy loop: while the only movable request waits for the supervisor, there is no work."""
    engine = engine_for(loaded)
    engine.submit("head", _prompt(engine), max_tokens=2)
    engine.submit("next", _prompt(engine), max_tokens=2)
    full = lambda: 10 * GiB - 1024  # noqa: E731
    assert isinstance(engine.step(GUARDED, full)[0], NeedMemory)
    assert engine.running == 2 and not engine.has_work
    engine.abort_all("done")
    assert engine.has_work  # the two terminal events wait in the outbox
    run = drive(engine, GUARDED, full)
    assert run.terminal("head").code == run.terminal("next").code == "aborted"


# ------------------------------------------------------------------ prefill chunk time, context, warm-up


def test_prefill_chunks_are_sized_by_time_not_only_by_memory(loaded):
    """A step is how long a command waits: chunks aim at chunk_seconds whatever
    the memory plan allows (512 tokens took 4.7-12.2 s on a small CPU)."""
    from worker.prefill import FIRST_CHUNK, ChunkTimer

    engine = engine_for(loaded, max_chunk=512, chunk_seconds=1.0)
    engine.chunk_timer.per_token = 0.1  # as if the last chunk took 0.1 s a token: 10 tokens fit 1 s
    engine.submit("long", _prompt(engine, "word " * 300), max_tokens=1)
    engine.step(OPEN, lambda: 0)
    assert engine.prompt_tokens_processed == 16  # MIN_TIMED_CHUNK: never fewer
    engine.abort_all("done")
    drive(engine)
    timer = ChunkTimer(0.5)
    assert timer.cap(512) == FIRST_CHUNK  # nothing timed yet: a small first chunk
    timer.learn(1.0, 100)  # 10 ms a token
    assert timer.cap(512) == 50
    timer.learn(4.0, 50)  # slower (attention grows): jumps up at once
    assert timer.cap(512) == 16
    timer.learn(0.1, 100)  # faster: decays slowly
    assert 16 <= timer.cap(512) < 50
    assert ChunkTimer(0).cap(512) == 512  # 0 = by memory only


def test_a_prompt_that_leaves_no_room_for_max_tokens_fails_naming_both(loaded):
    engine = engine_for(loaded)
    engine.context_length = 64
    prompt = _prompt(engine, "word " * 60)
    engine.submit_generate(Generate(request_id="r", prompt="word " * 60, max_tokens=16))
    end = drive(engine).terminal("r")
    assert isinstance(end, Failed) and end.code == "context_length_exceeded"
    assert f"the prompt ({len(prompt)} tokens) plus max_tokens (16)" in end.message
    assert "context of 64 tokens" in end.message


def test_an_over_long_prompt_is_refused_by_us_without_the_tokenizers_own_warning(tiny_model, tmp_path):
    """transformers logs "Token indices sequence length is longer than the specified maximum
    ... will result in indexing errors" when a prompt passes the tokenizer's model_max_length,
    for a prompt the engine then refuses cleanly: a line that reads like our crash. The
    engine keeps the context limit (config.json's) and the tokenizer is told it has none."""
    import json
    import logging
    import shutil

    folder = tmp_path / "short"
    shutil.copytree(tiny_model, folder)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        data = json.loads((folder / name).read_text())
        data[key] = 64
        (folder / name).write_text(json.dumps(data))
    said: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    library = logging.getLogger("transformers")  # its own handler; it does not propagate to the root
    library.addHandler(handler)
    try:
        engine = Engine.load(folder)
        engine.submit_generate(Generate(request_id="r", prompt="word " * 200, max_tokens=4))
        end = drive(engine).terminal("r")
    finally:
        library.removeHandler(handler)
    assert isinstance(end, Failed) and end.code == "context_length_exceeded" and "context of 64 tokens" in end.message
    assert not [line for line in said if "Token indices sequence length" in line], said


def test_warm_up_leaves_no_trace_and_serving_is_unchanged(loaded):
    """The GPU warm-up runs real requests (one alone, then a group) before serving; afterwards
    nothing of them is left: no request, no batch rows, counters and learned costs as loaded,
    and a request gets the tokens a fresh engine gives."""
    fresh = engine_for(loaded)
    prompt = _prompt(fresh)
    fresh.submit("a", prompt, max_tokens=6)
    want = drive(fresh).tokens("a")
    engine = engine_for(loaded)
    cost, per_token = engine.cost, engine.chunk_timer.per_token
    assert engine.warm_up() > 0
    assert not engine.has_work and engine.running == 0 and engine.queued == 0
    assert not engine.endings.ids and len(engine.decode.batch) == 0
    assert engine.tokens_total == 0 and engine.prompt_tokens_processed == 0
    assert engine.cost == cost and engine.chunk_timer.per_token == per_token
    engine.submit("a", prompt, max_tokens=6)
    assert drive(engine).tokens("a") == want


def test_streamed_text_of_a_long_reply_is_its_decode_and_the_detokenizer_keeps_a_tail(loaded):
    """worker/decode.py reads each token's text with `segment`, which lets mlx_lm's streaming
    detokenizer forget what was read (it copied the whole reply on every token): the text
    streamed is still exactly the decode of the tokens, and what the detokenizer holds stays small."""
    from worker.decode import KEEP_TEXT, segment

    _, tokenizer = loaded
    ids = tokenizer.encode("The memory guard watches every model, and steps in early. " * 60)
    detok = tokenizer.detokenizer
    detok.reset()
    pieces, held = [], 0
    for token in ids:
        detok.add_token(token)
        pieces.append(segment(detok))
        held = max(held, len(detok.text))
    detok.finalize()
    pieces.append(segment(detok))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert held <= KEEP_TEXT + 64 < len("".join(pieces)) // 4
