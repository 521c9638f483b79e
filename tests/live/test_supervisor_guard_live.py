"""The guard in a running supervisor, with real worker processes, real ZeroMQ and real MLX on the
CPU: a custom ceiling below two models stops the idle LRU one (P6.2), a recorded trace replays to
the same decisions, a trace that cannot be written stops tracing and not the guard, a ceiling
past 64 bits is refused (T6). Each test runs an `Arbiter` inside the test's own event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from shared import protocol as p
from supervisor.arbiter import Arbiter
from supervisor.config import ModelConfig
from supervisor.policy.decisions import Stop
from supervisor.policy.snapshot import Snapshot
from tests.arbiter_harness import Running, make_config
from tests.http_harness import until

pytestmark = pytest.mark.slow


def test_custom_ceiling_below_two_models_stops_the_idle_lru_one(tiny_models, runtime_dir):
    """Two idle non-pinned models over soft: the least recently used goes (P6.2), with an event saying why."""
    config = make_config(
        [ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="b", path=str(tiny_models.b))],
    )

    async def main():
        async with Running(config, runtime_dir) as arb:
            a = await arb.models.load("a")
            b = await arb.models.load("b")
            await until(lambda: a.sample is not None and b.sample is not None, what="samples")
            arb.wake()
            await asyncio.sleep(0.3)
            usage = arb.enforcer.last.usage
            # A soft watermark (0.90 of the custom ceiling) half a model below usage:
            # stopping one idle model is enough, whatever the supervisor's own footprint
            # (in a long test session this process holds hundreds of MiB).
            ceiling = int((usage - min(a.sample.memory.usage, b.sample.memory.usage) // 2) / 0.90)
            arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=ceiling))
            await until(lambda: a.state in ("draining", "stopped"), what="LRU model a evicted")
            assert b.state in ("ready", "busy")
            evictions = [e for e in arb.events if e.kind == "evict"]
            assert evictions and evictions[0].model_id == "a" and evictions[0].reason

    asyncio.run(main())


def test_a_recorded_trace_replays_to_the_same_decisions(tiny_models, runtime_dir, tmp_path):
    """serve --trace records what the guard saw; replaying it gives what it decided."""
    from supervisor.policy.replay import replay_lines

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="b", path=str(tiny_models.b))])
    trace = tmp_path / "trace.jsonl"

    async def main():
        arb = Arbiter(config, runtime_dir, max_workers=8, http=False, trace=trace)
        task = asyncio.get_running_loop().create_task(arb.run())
        await until(lambda: arb.running, what="start")
        await arb.models.load("a")
        await arb.models.load("b")
        await until(lambda: all(h.sample for h in arb.pool.handles.values()), what="samples")
        arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=arb.enforcer.last.usage // 2))
        await until(lambda: len(arb.pool.handles) < 2, what="an eviction")
        arb.stop()
        await task
        return [e.worker_id for e in arb.events if e.kind == "evict"]

    evicted_live = asyncio.run(main())
    assert evicted_live
    lines = trace.read_bytes().splitlines()
    assert len(lines) > 3 and all(msgspec.json.decode(line, type=Snapshot) for line in lines)
    replayed = list(replay_lines(lines, chained=False))
    stopped = [d.worker for r in replayed for d in r.decisions if isinstance(d, Stop)]
    assert stopped[: len(evicted_live)] == evicted_live


def test_a_trace_that_cannot_be_written_stops_tracing_not_the_guard(tiny_models, runtime_dir, caplog):
    """serve --trace on a full disk: the write's OSError escaped the enforcer's tick
    into the arbiter's loop and stopped the supervisor, and its workers with it."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        arb = Arbiter(config, runtime_dir, max_workers=8, http=False, trace=Path("/dev/full"))
        task = asyncio.get_running_loop().create_task(arb.run())
        await until(lambda: arb.running, what="start")
        ticks = arb.enforcer.ticks
        while arb.enforcer.ticks < ticks + 50 and not task.done():  # past the file's write buffer
            arb.wake()
            await asyncio.sleep(0.005)
        assert not task.done() and arb.running
        assert arb.enforcer.trace is None
        assert any("tracing stops" in r.getMessage() for r in caplog.records)
        arb.stop()
        assert await asyncio.wait_for(task, 30) == 0

    asyncio.run(main())


def test_t6_a_custom_ceiling_past_64_bits_is_refused_and_the_guard_keeps_ticking(tiny_models, runtime_dir):
    """A GuardUpdate carries up to 2**64-1. Past int64 the ceiling cannot go into the
    ledger's limits, so no worker got new limits again (one logged exception per
    tick); past 2**64 (an HTTP or config size) it could not even be published and
    the tick raised inside the arbiter's loop, stopping the supervisor."""
    from supervisor.wiring.control_answers import handle_control

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            reply = await handle_control(arb.service, p.GuardUpdate(tier="custom", custom_ceiling=2**64 - 1))
            assert isinstance(reply, p.ControlError) and reply.code == "invalid_request"
            assert "custom ceiling" in reply.message and arb.enforcer.settings.custom_ceiling == 0
            ticks = arb.enforcer.ticks
            arb.wake()
            await until(lambda: arb.enforcer.ticks > ticks, what="another tick")
            assert arb.running

    asyncio.run(main())
