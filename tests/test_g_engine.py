"""SPEC G1-G3 in the worker's MLX engine on real tiny models (CPU): the prefill guard asks for
memory, waits, retries and refuses, sizes its chunks near the target, reclaims over the abort
limit, holds a prefill on a discrete device to the device pool (D), and learns its cost.
The guard's arithmetic alone is tests/test_g_prefill_guard.py."""

from __future__ import annotations

import msgspec

from shared.protocol import Failed, Finished, NeedMemory, Prompted
from shared.sizes import GiB
from tests.engine_harness import GUARDED, Run, drive, engine_for
from tests.engine_harness import prompt_tokens as _prompt
from worker.engine import Engine
from worker.prefill_guard import padded_chunk_bytes

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
