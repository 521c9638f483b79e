"""Issue 9: the guard's cross-process contracts, each through a real supervisor,
real worker processes and the messages on the wire (the lab scenarios in
tests/test_lab.py cover G1, P6 at hard with a stop under way, and P6.3)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import probe
from shared import protocol as p
from shared.probe import nvml
from shared.sizes import GiB
from supervisor.config import GuardConfig, ModelConfig
from tests.arbiter_harness import Running, collect, make_config

pytestmark = pytest.mark.slow


@pytest.fixture
def runtime_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rt", numbered=True)


def test_p9_idle_cadence_is_applied_heartbeats_do_not_tick_the_policy(tiny_models, runtime_dir):
    """Status said 10 s while the enforcer ran on every 1 s heartbeat."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], heartbeat_interval=0.2)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            await asyncio.sleep(3.0)  # the load's activity hint (2 s) runs out
            ticks, pongs = arb.enforcer.ticks, handle.beats.last_pong
            await asyncio.sleep(3.0)
            assert arb.enforcer.status().poll_interval == 10.0
            assert arb.enforcer.ticks - ticks <= 1, "the policy ticked on heartbeats"
            assert handle.beats.last_pong > pongs, "heartbeats must go on"
            ticks = arb.enforcer.ticks
            stream = await arb.service.generate("a", p.Generate(request_id="r", prompt="hi", max_tokens=4))
            await collect(stream)
            assert arb.enforcer.ticks > ticks, "a request is an event: it wakes the policy at once"

    asyncio.run(main())


def test_u1_a_workers_sample_on_the_wire_counts_its_pool(tiny_models, runtime_dir):
    """The pool is memory the OS sees as taken (U1 as changed 2026-12-01)."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.small))], heartbeat_timeout=30.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            stream = await arb.service.generate("a", p.Generate(request_id="r", prompt="the sea " * 40, max_tokens=2))
            await collect(stream)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                arb.wake()
                await asyncio.sleep(0.1)
                s = arb.ledger.read_sample(handle.slot)
                if s is not None and s.memory.mlx_pool > 0:
                    break
            assert s is not None and s.memory.mlx_pool > 0
            m = s.memory
            if probe.gpu_kind(handle.device_info) == "cuda":
                # D1: on a discrete device MLX's active and pool bytes are device memory;
                # host usage is the footprint alone (the device pool counts the rest)
                assert m.usage == m.footprint
            else:
                assert m.usage == max(m.mlx_active, m.footprint) and m.usage >= m.mlx_pool

    asyncio.run(main())


def test_cuda_device_memory_is_reported_not_folded_into_the_host_ceiling(tiny_models, runtime_dir, monkeypatch):
    """A 24 GiB GPU on a bigger host made a 24 GiB host ceiling. The worker's
    hello is replaced by what MLX's CUDA backend reports, and NVML is made
    unreadable so the hello is the reading (D1's fallback; on a real GPU NVML
    would give the real device instead)."""
    monkeypatch.setattr(nvml, "read_device", lambda *a, **k: None)
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))],
                         guard=GuardConfig(tier="custom", custom_ceiling=0))

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            arb.pool.set_device_info(handle, {"device_name": "NVIDIA H200", "architecture": "sm_90",
                                              "total_memory": 1 * GiB})
            snap = arb.enforcer.snapshot(time.monotonic())
            assert snap.gpu_cap_raw == 0 and snap.device_total == 1 * GiB
            arb.enforcer.tick(time.monotonic())
            status = arb.enforcer.status()
            assert status.binding == "static" and status.gpu_cap == 0
            assert status.ceiling > 1 * GiB
            assert status.device is not None and status.device.total == 1 * GiB  # D6: its own pool
            assert status.device.name == "NVIDIA H200"

    asyncio.run(main())
