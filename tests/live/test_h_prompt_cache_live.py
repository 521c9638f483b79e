"""The prompt cache through real processes (SPEC H1-H3, P5, C12): a worker's samples carry
its cache bytes, a shrink frees them, and the guard shrinks caches under hard pressure
before it aborts anything."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import protocol as p
from shared.limits import Limits
from shared.sizes import GiB, MiB
from supervisor.config import GuardConfig, ModelConfig
from tests.arbiter_harness import Running, collect
from tests.http_harness import LiveServer, metric, until
from tests.http_harness import make_config as harness_config
from tests.worker_harness import FakeSupervisor

pytestmark = pytest.mark.slow

LONG = "a long system prompt that every request of this test shares word for word " * 12


def _samples(sup: FakeSupervisor, timeout: float = 10.0):
    """Samples the worker pushed, as they arrive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sup.pull.poll(100):
            msg = p.Codec(p.WorkerReport).decode(sup.pull.recv())
            if isinstance(msg, p.Sample):
                yield msg


def test_h2_h3_worker_samples_carry_cache_bytes_and_a_shrink_frees_them(tiny_model, tmp_path):
    with FakeSupervisor(tmp_path, tiny_model, "w#c") as sup:
        sup.recv(p.Loaded)
        sup.ledger.write_limits(0, Limits(max_concurrency=4, cache_cap=64 * MiB, pool_max=GiB))
        sup.send(p.Generate(request_id="r1", prompt=LONG, max_tokens=4))
        first = sup.recv(p.Finished)
        sup.send(p.Generate(request_id="r2", prompt=LONG + " and one more question", max_tokens=4))
        second = sup.recv(p.Finished)
        assert first.cached_tokens == 0 and second.cached_tokens >= first.prompt_tokens - 1
        held = sup.ledger.read_sample(0).memory
        assert held.cache_bytes > 0 and held.cache_releasable == held.cache_bytes
        sup.send(p.ShrinkCache(target_bytes=0, reason="test"))
        sup.recv(p.Reclaimed)
        shrunk = next(s for s in _samples(sup) if s.why == "shrink").memory
        assert shrunk.cache_bytes == 0 and shrunk.cache_releasable == 0
        # real bytes: MLX holds less by at least most of what the cache held
        assert held.mlx_active - shrunk.mlx_active >= held.cache_bytes * 0.9
        assert sup.ledger.read_sample(0).memory.cache_bytes == 0
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)


def test_p5_hard_pressure_shrinks_the_prompt_cache_before_any_abort(tiny_models, runtime_dir):
    guard = GuardConfig(hot_cache_max=64 * MiB)
    config = harness_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)], guard=guard,
                            heartbeat_interval=0.2, heartbeat_timeout=2.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            for i in range(3):
                stream = await arb.service.generate("a", p.Generate(request_id=f"r{i}", prompt=f"{i} {LONG}",
                                                            max_tokens=4))
                _, end = await collect(stream)
                assert isinstance(end, p.Finished)
            await until(lambda: handle.sample is not None and handle.sample.memory.cache_bytes > 0, what="cache")
            held, active = handle.sample.memory.cache_bytes, handle.sample.memory.mlx_active
            arb.wake()
            await asyncio.sleep(0.3)
            # Custom tier: soft 0.90, hard 0.97 of the ceiling; usage sits at 0.975 of it.
            ceiling = int(arb.enforcer.last.usage / 0.975)
            arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=ceiling))
            await until(lambda: handle.sample.memory.cache_bytes == 0, what="the cache shrunk")
            kinds = [e.kind for e in arb.events]
            assert "shrink_cache" in kinds
            shrink = kinds.index("shrink_cache")
            assert "abort" not in kinds[:shrink]
            event = arb.events[shrink]
            assert event.model_id == "a" and "prompt cache" in event.reason
            assert held > 0 and handle.state in ("ready", "busy")
            assert active - handle.sample.memory.mlx_active >= held * 0.9  # real bytes left MLX
            arb.enforcer.update_guard(p.GuardUpdate(enabled=False))

    asyncio.run(main())


@pytest.fixture
def runtime_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rt", numbered=True)


def test_h1_openai_usage_reports_cached_tokens_and_metrics_show_the_cache(tiny_models, runtime_dir):
    guard = GuardConfig(hot_cache_max=64 * MiB)
    config = harness_config([ModelConfig(id="a", path=str(tiny_models.a))], guard=guard)
    with LiveServer(config, runtime_dir) as server:
        async def main():
            client = server.openai()
            messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "hello"}]
            first = await client.chat.completions.create(model="a", messages=messages, max_tokens=4)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and then?"}]
            second = await client.chat.completions.create(model="a", messages=messages, max_tokens=4)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert first.usage.prompt_tokens - 4 <= cached < second.usage.prompt_tokens
            async with server.client() as c:
                await until(lambda: server.arbiter.pool.handles and all(
                    h.sample and h.sample.memory.cache_bytes for h in server.arbiter.pool.handles.values()),
                    what="a sample with cache bytes")
                text = (await c.get("/metrics")).text
                status = (await c.get("/status")).json()["guard"]
            assert metric(text, "memvisor_prompt_cache_bytes") > 0
            assert metric(text, "memvisor_prompt_cache_budget_bytes") == 64 * MiB
            assert metric(text, "memvisor_worker_prompt_cache_bytes", model="a") > 0
            assert status["hot_cache_max"] == 64 * MiB and status["hot_cache_used"] > 0

        server.run(main())
