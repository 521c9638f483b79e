"""The fire drill: real MLX allocations at a set rate, released at once."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shared.sizes import MiB
from worker.drill import ADVANCE_SLICE, MIN_STEP_BYTES, DrillAllocation, DrillError


@pytest.fixture(autouse=True)
def _clean_mlx():
    mx.clear_cache()
    yield
    mx.clear_cache()


def test_drill_grows_at_the_rate_on_an_injected_clock():
    base = mx.get_active_memory()
    drill = DrillAllocation(rate=128 * MiB, target=64 * MiB, now=0.0)
    assert drill.advance(0.0) == 0
    for i in range(1, 32):  # the worker loop comes by every 10 ms
        drill.advance(i * 0.01)
    assert drill.held == pytest.approx(128 * MiB * 0.31, abs=MIN_STEP_BYTES)  # on schedule
    assert mx.get_active_memory() - base == drill.held
    for i in range(32, 200):
        drill.advance(i * 0.01)
    assert drill.done and drill.held == 64 * MiB  # capped at the target
    assert drill.advance(30.0) == 0
    drill.release()


def test_drill_one_advance_allocates_at_most_one_slice():
    """A worker that was held up for a second must not then stall again in one
    giant catch-up allocation: it would not read the command that stops the
    drill until the allocation is done (seen: 0.5 s, then 1.5 s, then 2 s)."""
    drill = DrillAllocation(rate=1024 * MiB, target=4096 * MiB, now=0.0)
    got = drill.advance(1.0)  # 1 GiB owed
    assert got == int(1024 * MiB * ADVANCE_SLICE)
    assert drill.held == got
    drill.release()


def test_drill_waits_for_a_whole_step_instead_of_tiny_arrays():
    drill = DrillAllocation(rate=1 * MiB, target=10 * MiB, now=0.0)
    assert drill.advance(0.5) == 0               # half a MiB owed: not yet
    assert drill.next_due(0.5) == pytest.approx(0.5)
    assert drill.advance(1.0) == MIN_STEP_BYTES
    drill.release()


def test_drill_pieces_stay_bounded():
    drill = DrillAllocation(rate=10**12, target=40 * MiB, now=0.0, piece_bytes=16 * MiB)
    assert [drill.advance(1.0) for _ in range(4)] == [16 * MiB, 16 * MiB, 8 * MiB, 0]
    assert [p.nbytes for p in drill._pieces] == [16 * MiB, 16 * MiB, 8 * MiB]
    drill.release()


def test_drill_memory_is_committed_and_release_returns_it():
    """The drill must take memory the OS has to find (footprint), and give it all back."""
    from worker.own_memory import sample

    before = sample()
    drill = DrillAllocation(rate=10**12, target=128 * MiB, now=0.0)
    while not drill.done:
        drill.advance(1.0)
    grown = sample()
    assert grown.mlx_active - before.mlx_active == 128 * MiB
    assert grown.footprint - before.footprint >= 120 * MiB  # pages written, not just reserved
    assert drill.release() == 128 * MiB
    after = sample()
    assert after.mlx_active == before.mlx_active
    assert after.mlx_pool == 0
    assert after.footprint - before.footprint < 16 * MiB
    assert drill.held == 0 and not drill.done


@pytest.mark.parametrize("rate, target, fragment", [(0, 1, "rate"), (1, 0, "size"), (-5, 10, "rate")])
def test_drill_bad_arguments_are_clear_errors(rate, target, fragment):
    with pytest.raises(DrillError, match=fragment):
        DrillAllocation(rate=rate, target=target, now=0.0)


def test_drill_advances_between_engine_steps_while_requests_run(tiny_model):
    """The worker loop advances the drill at every step boundary, busy or idle."""
    from shared.limits import Limits
    from worker.engine import Engine

    engine = Engine.load(tiny_model, own_usage_fn=lambda: 0)
    engine.submit("r", engine.encode_prompt("Once upon a time"), max_tokens=8)
    drill = DrillAllocation(rate=256 * MiB, target=512 * MiB, now=0.0)
    clock, tokens, held = 0.0, [], []
    while engine.has_work:
        engine.step(Limits(), lambda: 0)
        clock += 0.01
        drill.advance(clock)
        tokens.append(engine.tokens_total)
        held.append(drill.held)
    assert tokens[-1] == 8
    assert held[-1] == pytest.approx(256 * MiB * clock, abs=MIN_STEP_BYTES)
    assert held == sorted(held) and held[0] > 0
    idle_before = drill.held
    drill.advance(clock + 0.01)  # idle: no engine step, the drill still grows
    assert drill.held > idle_before
    drill.release()
