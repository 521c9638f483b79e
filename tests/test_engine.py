"""The worker's MLX engine on real tiny models (CPU): generation, scheduling, SPEC P3/P8/G1-G3."""

from __future__ import annotations

import mlx.core as mx
import msgspec
import pytest

from shared.limits import Limits
from shared.protocol import ChatMessage, Failed, Finished, Generate, NeedMemory, Prompted, TokenOut
from shared.sizes import GiB
from tests.engine_harness import GUARDED, OPEN, Run, drive, engine_for
from worker.engine import Engine, EngineError
from worker.prefill_guard import padded_chunk_bytes
from worker.stops import StopMatcher


def _prompt(engine: Engine, text: str = "Once upon a time") -> list[int]:
    return engine.encode_prompt(text)


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


# ------------------------------------------------------------------ aborts and bad input


def test_abort_gives_exactly_one_terminal_failed_wherever_the_request_is(loaded):
    engine = engine_for(loaded)
    for rid in ("decoding", "queued"):
        engine.submit(rid, _prompt(engine), max_tokens=50)
    limits = Limits(max_concurrency=1)
    run = Run()
    while engine.tokens_total < 2:
        run.add(engine.step(limits, lambda: 0))
    assert engine.abort("decoding", "pressure", code="aborted")
    assert engine.abort("queued", "pressure")
    assert not engine.abort("never-seen", "x")
    run.add(drive(engine, limits).events)
    for rid in ("decoding", "queued"):
        end = run.terminal(rid)
        assert isinstance(end, Failed) and (end.code, end.message) == ("aborted", "pressure")
    assert engine.running == engine.queued == 0


def test_abort_all_and_abort_queued(loaded):
    engine = engine_for(loaded)
    for i in range(3):
        engine.submit(f"r{i}", _prompt(engine), max_tokens=50)
    limits = Limits(max_concurrency=1)
    run = Run()
    run.add(engine.step(limits, lambda: 0))
    assert engine.abort_queued("unloading", code="model_unloading") == 2
    run.add(engine.step(limits, lambda: 0))
    assert engine.abort_all("emergency") == 1
    run.add(drive(engine, limits).events)
    assert [run.terminal(f"r{i}").code for i in range(3)] == ["aborted", "model_unloading",
                                                              "model_unloading"]


@pytest.mark.parametrize(
    "cmd, fragment",
    [
        (Generate(request_id="x"), "exactly one of messages or prompt"),
        (Generate(request_id="x", prompt="a", messages=[ChatMessage(role="user", content="b")]),
         "exactly one"),
        (Generate(request_id="x", prompt="hi", max_tokens=0), "max_tokens"),
        (Generate(request_id="x", prompt="hi", temperature=-1.0), "temperature"),
        (Generate(request_id="x", prompt="hi", top_p=0.0), "top_p"),
        (Generate(request_id="x", messages=[]), "messages must not be empty"),
    ],
)
def test_bad_generate_becomes_one_invalid_request_failure(loaded, cmd, fragment):
    engine = engine_for(loaded)
    engine.submit_generate(cmd)
    end = drive(engine).terminal("x")
    assert isinstance(end, Failed) and end.code == "invalid_request"
    assert fragment in end.message


class _BrokenTokenizer:
    """The real tokenizer, except that encoding `text` raises (a tokenizer bug)."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text = tokenizer, text

    def encode(self, text, **kwargs):
        if text == self.text:
            raise IndexError("tokenizer bug")
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_generate_that_cannot_be_prepared_fails_alone_and_the_engine_keeps_serving(loaded):
    """Anything raised while taking a Generate escapes into the worker's command
    loop and kills the worker with every stream on it (a negative seed did)."""
    model, tokenizer = loaded
    engine = Engine(model, _BrokenTokenizer(tokenizer, "boom"), own_usage_fn=lambda: 0)
    engine.submit_generate(Generate(request_id="ok", prompt="fine", max_tokens=3))
    engine.submit_generate(Generate(request_id="bad", prompt="boom", max_tokens=3))
    run = drive(engine)
    bad = run.terminal("bad")
    assert isinstance(bad, Failed) and bad.code == "engine_error" and "tokenizer bug" in bad.message
    assert isinstance(run.terminal("ok"), Finished)


def test_duplicate_request_id_and_out_of_vocab_tokens_are_refused(loaded):
    engine = engine_for(loaded)
    engine.submit("same", [1, 2, 3], max_tokens=2)
    with pytest.raises(EngineError, match="already in use"):
        engine.submit("same", [1, 2, 3])
    with pytest.raises(EngineError, match="outside"):
        engine.submit("big", [10**7])
    drive(engine)


def test_model_without_chat_template_refuses_chat(tmp_path, tiny_model):
    import json
    import shutil

    copy = tmp_path / "plain"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine.load(copy, own_usage_fn=lambda: 0)
    with pytest.raises(EngineError, match="no chat template"):
        engine.encode_chat([{"role": "user", "content": "hi"}])


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(EngineError, match="config.json not found") as info:
        Engine.load(tmp_path / "nowhere")
    assert info.value.code == "load_failed"


# ------------------------------------------------------------------ prefill guard (G1-G3)

def test_g1_need_memory_then_retry_once_after_the_answer(loaded):
    usage = {"now": 10 * GiB - 1024}  # no room for any prompt
    engine = engine_for(loaded)
    engine.submit("r", _prompt(engine), max_tokens=3)
    events = engine.step(GUARDED, lambda: usage["now"])
    assert [type(ev) for ev in events] == [NeedMemory]
    assert events[0].need_bytes > 0
    assert engine.step(GUARDED, lambda: usage["now"]) == []  # waits, does not prefill
    assert not engine.has_work  # the loop may block until the answer comes
    usage["now"] = 1 * GiB  # the supervisor stopped an idle model
    engine.memory_answer("r", evicted=True)
    end = drive(engine, GUARDED, lambda: usage["now"]).terminal("r")
    assert isinstance(end, Finished)


def test_g1_still_no_room_after_retry_rejects_with_estimate_limit_and_binding(loaded):
    engine = engine_for(loaded)
    engine.submit("r", _prompt(engine), max_tokens=3)
    full = lambda: 10 * GiB - 1024  # noqa: E731
    assert isinstance(engine.step(GUARDED, full)[0], NeedMemory)
    engine.memory_answer("r", evicted=False)
    run = drive(engine, GUARDED, full)
    end = run.terminal("r")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert end.limit_bytes == 10 * GiB and end.estimated_bytes > end.limit_bytes
    assert end.binding == "dynamic" and "close other applications" in end.message
    assert not [ev for ev in run.events if isinstance(ev, NeedMemory)], "asked twice"


def test_g1_no_answer_retries_by_itself_after_the_wait(loaded):
    """A lost answer must not strand the request forever."""
    clock = {"t": 0.0}
    engine = engine_for(loaded, clock=lambda: clock["t"], memory_wait=5.0)
    engine.submit("r", _prompt(engine), max_tokens=2)
    full = lambda: 10 * GiB - 1024  # noqa: E731
    assert isinstance(engine.step(GUARDED, full)[0], NeedMemory)
    assert engine.next_deadline() == 5.0
    clock["t"] = 4.9
    assert engine.step(GUARDED, full) == []
    clock["t"] = 5.0
    end = drive(engine, GUARDED, full).terminal("r")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"


def test_g1_prompt_too_big_for_the_machine_is_rejected_without_eviction(loaded):
    """Evicting other users' models cannot help when this worker alone is over the limit."""
    engine = engine_for(loaded, own_usage_fn=lambda: 10 * GiB)
    engine.submit("r", _prompt(engine), max_tokens=2)
    run = drive(engine, GUARDED, lambda: 10 * GiB)
    assert not [ev for ev in run.events if isinstance(ev, NeedMemory)]
    assert run.terminal("r").code == "prefill_memory_exceeded"


def test_g1_decoding_continues_while_another_request_waits_for_memory(loaded):
    usage = {"now": 1 * GiB}
    engine = engine_for(loaded)
    engine.submit("running", _prompt(engine), max_tokens=30)
    while not engine.tokens_total:
        engine.step(GUARDED, lambda: usage["now"])
    usage["now"] = 10 * GiB - 1024
    engine.submit("late", _prompt(engine), max_tokens=2)
    run = Run()
    for _ in range(6):
        run.add(engine.step(GUARDED, lambda: usage["now"]))
    assert any(isinstance(ev, NeedMemory) for ev in run.events)
    assert len(run.tokens("running")) >= 4
    engine.abort_all("done")
    drive(engine, GUARDED, lambda: usage["now"])


def test_g2_no_room_for_the_floor_mid_prefill_asks_once_then_aborts_and_frees_the_kv_cache(loaded):
    """Mid-prefill the machine fills up: the floor chunk asks for room once (G2, 2026-12-05);
    with nothing freed the request is refused and its KV so far goes back."""
    reclaims = []
    readings = iter([1 * GiB, 1 * GiB, 1 * GiB])  # preflight, first chunk plan, after chunk

    def usage():
        return next(readings, 10 * GiB)  # then the machine fills up

    engine = engine_for(loaded, max_chunk=8, reclaim_fn=lambda: reclaims.append(1) or 0)
    engine.submit("long", _prompt(engine, "word " * 40), max_tokens=2)
    run = drive(engine, GUARDED, usage)
    [need] = [ev for ev in run.events if isinstance(ev, NeedMemory)]
    assert need.need_bytes > 0 and not engine.has_work  # held for the answer, its chunk so far kept
    engine.memory_answer("long", evicted=False)
    run.add(drive(engine, GUARDED, usage).events)
    end = run.terminal("long")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert engine.prompt_tokens_processed == 8  # exactly one chunk ran
    assert reclaims, "the aborted prefill's memory was not returned"
    assert not run.tokens("long")
    assert len([ev for ev in run.events if isinstance(ev, NeedMemory)]) == 1, "asked twice"


def _g1_fits_g2_floor_does_not(engine: Engine, prompt: list[int]) -> int:
    """A usage under which G1 lets `prompt` in (the hard limit) but G2's floor chunk does not fit its
    target (hard x headroom safety): the gap the issue measured (usage just under soft)."""
    target = int(GUARDED.hard_limit * GUARDED.prefill_headroom_safety)
    usage = target - padded_chunk_bytes(engine.cost, 0, GUARDED.min_chunk_tokens) + 1
    assert usage + padded_chunk_bytes(engine.cost, 0, len(prompt)) < GUARDED.hard_limit  # G1 fits
    return usage


def test_g2_a_floor_chunk_that_does_not_fit_asks_for_room_and_runs_once_it_is_made(loaded):
    """G2 (2026-12-05): a prompt G1 let in asks the supervisor for room at its floor chunk, G1's
    message and `need_bytes` meaning (the shortfall), and is served once the room is made."""
    engine = engine_for(loaded)
    prompt = _prompt(engine, "word " * 20)
    usage = {"now": _g1_fits_g2_floor_does_not(engine, prompt)}
    engine.submit("r", prompt, max_tokens=3)
    run = drive(engine, GUARDED, lambda: usage["now"])
    [need] = [ev for ev in run.events if not isinstance(ev, Prompted)]  # G1 let it in: its prompt is final
    target = int(GUARDED.hard_limit * GUARDED.prefill_headroom_safety)
    assert isinstance(need, NeedMemory) and need.pool == "host"
    assert need.need_bytes == usage["now"] + padded_chunk_bytes(engine.cost, 0, GUARDED.min_chunk_tokens) - target
    assert not engine.has_work and engine.prompt_tokens_processed == 0  # held, nothing ran
    usage["now"] = 1 * GiB  # the supervisor stopped an idle model
    engine.memory_answer("r", evicted=True)
    end = drive(engine, GUARDED, lambda: usage["now"]).terminal("r")
    assert isinstance(end, Finished) and end.prompt_tokens == len(prompt)


def test_g2_a_held_prefill_with_no_answer_retries_by_itself_after_the_wait(loaded):
    """A lost answer must not strand a prefill held at its floor chunk either."""
    clock = {"t": 0.0}
    engine = engine_for(loaded, clock=lambda: clock["t"], memory_wait=5.0)
    prompt = _prompt(engine, "word " * 20)
    usage = _g1_fits_g2_floor_does_not(engine, prompt)
    engine.submit("r", prompt, max_tokens=2)
    assert isinstance(engine.step(GUARDED, lambda: usage)[-1], NeedMemory)
    assert engine.next_deadline() == 5.0
    clock["t"] = 5.0
    end = drive(engine, GUARDED, lambda: usage).terminal("r")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert end.binding == "dynamic" and end.limit_bytes == int(GUARDED.hard_limit * GUARDED.prefill_headroom_safety)


def test_g2_chunks_shrink_near_the_target(loaded):
    engine = engine_for(loaded, max_chunk=64)
    prompt = _prompt(engine, "word " * 80)
    engine.submit("r", prompt, max_tokens=1)
    target = int(GUARDED.hard_limit * GUARDED.prefill_headroom_safety)
    room = padded_chunk_bytes(engine.cost, 0, 20)  # a chunk's padded cost (G2), KV steps included
    tight = lambda: target - room  # noqa: E731  room for ~20 tokens
    engine.step(GUARDED, tight)
    assert 4 <= engine.prompt_tokens_processed <= 20
    engine.abort_all("done")
    drive(engine, GUARDED, tight)


def test_g3_over_abort_limit_reclaims_then_continues_when_that_was_enough(loaded):
    calls = []
    readings = iter([1 * GiB, 1 * GiB, 13 * GiB])  # preflight, plan, after chunk: over abort

    def usage():
        return next(readings, 1 * GiB)  # after the reclaim: fine again

    engine = engine_for(loaded, max_chunk=8, reclaim_fn=lambda: calls.append("reclaim") or 0)
    engine.submit("r", _prompt(engine, "word " * 20), max_tokens=2)
    end = drive(engine, GUARDED, usage).terminal("r")
    assert isinstance(end, Finished)
    assert calls == ["reclaim"]


def test_g3_still_over_abort_limit_after_reclaim_fails_the_request(loaded):
    readings = iter([1 * GiB, 1 * GiB])

    def usage():
        return next(readings, 13 * GiB)

    engine = engine_for(loaded, max_chunk=8, reclaim_fn=lambda: 0)
    engine.submit("r", _prompt(engine, "word " * 20), max_tokens=2)
    end = drive(engine, GUARDED, usage).terminal("r")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert end.limit_bytes == 12 * GiB and end.binding == "static"


# The same guarded host pool, on a machine whose worker runs on a discrete device (SPEC D):
# the device pool's watermarks are the group's MLX active + pool at 18 and 19 GiB.
ON_DEVICE = msgspec.structs.replace(GUARDED, device_soft=18 * GiB, device_hard=19 * GiB)


def _on_device(loaded, group, own=lambda: 0, **kw) -> Engine:
    from worker.prefill import DeviceUsage

    return engine_for(loaded, device=DeviceUsage(group=group, own=own), **kw)


def test_g1_d_on_a_device_the_prefill_is_held_to_the_device_pool_not_host_ram(loaded):
    """On CUDA a prefill's KV and activations are device memory, and a worker's host usage is
    its footprint alone: with the host pool nearly empty and the device pool full, the prompt
    is refused naming the device pool (a 400 prefill_memory_exceeded, binding `device`);
    without a device (or a device the supervisor does not guard) the same prompt runs."""
    engine = _on_device(loaded, group=lambda: 19 * GiB - 1024, own=lambda: 19 * GiB - 1024)
    engine.submit("r", _prompt(engine, "word " * 20), max_tokens=2)
    run = drive(engine, ON_DEVICE, lambda: 1 * GiB)
    end = run.terminal("r")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert end.binding == "device" and end.limit_bytes == 19 * GiB
    assert "of device memory" in end.message and "device pool" in end.message
    cpu = engine_for(loaded)  # no discrete device: host RAM, whatever the limits say of a device
    unguarded = _on_device(loaded, group=lambda: 19 * GiB - 1024)  # no device watermarks handed out
    for engine, limits in ((cpu, ON_DEVICE), (unguarded, GUARDED)):
        engine.submit("r", _prompt(engine, "word " * 20), max_tokens=2)
        assert isinstance(drive(engine, limits, lambda: 1 * GiB).terminal("r"), Finished)


def test_g1_d_a_device_shortfall_asks_the_supervisor_for_room_in_the_device_pool(loaded):
    engine = _on_device(loaded, group=lambda: 19 * GiB - 1024, own=lambda: 1 * GiB)
    engine.submit("r", _prompt(engine), max_tokens=2)
    [need] = engine.step(ON_DEVICE, lambda: 1 * GiB)
    assert isinstance(need, NeedMemory) and need.pool == "device" and need.need_bytes > 0
    engine.abort_all("done")


def test_g1_d_requests_arriving_together_are_grouped_only_when_the_device_pool_holds_them_all(loaded):
    """A group is held to the device pool as a request alone is (G1 sums the members' estimates,
    G2 sizes the group's chunk as every row's summed): with room under the chunk target for one
    prefill and a half the two go one after the other, with room for three they go together."""
    from worker.prefill_guard import admission_peak, chunk_target, device_limits

    target = chunk_target(device_limits(ON_DEVICE)).bytes  # G2's, under G1's (the hard watermark)
    for room_for, together in ((1.5, False), (3.0, True)):
        used = {"device": 0}
        engine = _on_device(loaded, group=lambda: used["device"])  # noqa: B023 - read within the loop
        prompt = _prompt(engine, "word " * 20)
        used["device"] = target - int(room_for * admission_peak(len(prompt), engine.cost, ON_DEVICE.min_chunk_tokens))
        for rid in ("a", "b"):
            engine.submit(rid, prompt, max_tokens=2)
        run, grouped = Run(), False
        while engine.has_work:
            run.add(engine.step(ON_DEVICE, lambda: 1 * GiB))
            grouped = grouped or engine.scheduler.group is not None
        assert isinstance(run.terminal("a"), Finished) and isinstance(run.terminal("b"), Finished)
        assert grouped == together, room_for


def test_g3_d_over_the_device_hard_watermark_after_a_chunk_fails_naming_the_device(loaded):
    readings = iter([1 * GiB, 1 * GiB])  # preflight, plan; then the device pool is over

    engine = _on_device(loaded, group=lambda: next(readings, 19 * GiB + 1), max_chunk=8, reclaim_fn=lambda: 0)
    engine.submit("r", _prompt(engine, "word " * 20), max_tokens=2)
    end = drive(engine, ON_DEVICE, lambda: 1 * GiB).terminal("r")
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert end.binding == "device" and end.limit_bytes == 19 * GiB


def test_g2_measured_cost_replaces_the_prior(loaded):
    engine = engine_for(loaded, max_chunk=16)
    engine.submit("short", _prompt(engine, "hi"), max_tokens=1)
    drive(engine)
    assert engine.cost == prior_of(engine), "a tiny chunk's fixed costs must not be learned"
    prior = engine.cost
    engine.submit("r", _prompt(engine, "word " * 40), max_tokens=1)
    drive(engine)
    assert engine.cost != prior
    assert engine.cost.chunk_per_token >= engine.cost.kv_per_token > 0


def prior_of(engine: Engine):
    from worker.prefill_cost import prior_cost as _prior_cost

    return _prior_cost(engine.model, engine.max_chunk)


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


class _FailingModel:
    """The real model, except that call number `fail_at` raises as an MLX allocation failure
    would (fault injection: MLX on CPU reports malloc failure as RuntimeError)."""

    def __init__(self, model, fail_at: int):
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes.")
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("fail_at", [1, 2, 3])  # prefill chunk, first token, a decode step
def test_mlx_failure_fails_the_requests_involved_and_the_engine_keeps_serving(loaded, fail_at):
    """An exception escaping `step()` would kill the worker and every stream on it."""
    model, tokenizer = loaded
    reclaims = []
    engine = Engine(_FailingModel(model, fail_at), tokenizer, max_chunk=64, own_usage_fn=lambda: 0,
                    reclaim_fn=lambda: reclaims.append(1) or 0)
    engine.submit("hit", _prompt(engine, "a few words here"), max_tokens=4)
    end = drive(engine).terminal("hit")
    assert isinstance(end, Failed) and end.code == "engine_error" and "Unable to allocate" in end.message
    assert reclaims
    engine.submit("after", _prompt(engine), max_tokens=3)
    assert isinstance(drive(engine).terminal("after"), Finished)


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
