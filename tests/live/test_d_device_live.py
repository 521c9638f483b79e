"""The device pool's rules across real processes (SPEC D1, D4, D5, D6), rehearsed on the CPU;
a CUDA device is its own pool and never folds into the host ceiling (SPEC C).

CI has no GPU. These tests give a real worker's hello a CUDA-shaped
`device_info` (an 80 GiB device), so the supervisor guards a device pool whose
bytes are the worker's MLX active + pool (D1's fallback when NVML has no
figure) -- on this machine CPU memory standing in for device memory. What
crosses the wire is the same as on a GPU: the device watermarks in the limits,
the worker's at-once watermark sample, the enforcer's decision on the device
pool. The same path ran on an NVIDIA H200 with real device memory
(`scripts/bench_device_drill.py`, README).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import protocol as p
from shared.probe import nvml
from shared.sizes import GiB, MiB
from supervisor.config import GuardConfig, ModelConfig
from supervisor.doors.refusals import LoadError
from supervisor.policy import decisions as d
from tests.arbiter_harness import Running, make_config

pytestmark = pytest.mark.slow

PRETEND = {"device_name": "stand-in", "architecture": "cpu", "total_memory": 80 * GiB, "free_memory": 80 * GiB}


async def _load_on_pretend_device(arb, model_id: str):
    handle = await arb.models.load(model_id)
    handle.set_device_info(dict(PRETEND))
    for _ in range(100):
        arb.wake()
        await asyncio.sleep(0.05)
        last = arb.enforcer.last
        if last is not None and last.device is not None and last.device_usage > 0:
            return handle
    raise AssertionError("the device pool never showed the worker's bytes")


def test_d4_device_drill_is_stopped_by_the_guard_on_the_device_pool(tiny_models, runtime_dir):
    """A busy worker grows on the device past the device hard watermark: the
    guard aborts its requests naming the device pool (P6 step 3 there), in well
    under a second, while the host pool (64 GiB custom ceiling) stays ok."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), max_concurrency=1)], allow_drills=True,
                         guard=GuardConfig(tier="custom", custom_ceiling=64 * GiB, hot_cache_max=0))

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await _load_on_pretend_device(arb, "a")
            held, dc = arb.enforcer.last.device_usage, arb.enforcer.last.device
            # on a real GPU NVML's free leaves out what the driver keeps (D3 counts it as
            # others'): the custom value covers it, so the ceiling is 256 MiB over the group
            others = dc.others
            arb.service.update_guard(p.GuardUpdate(custom_device_ceiling=held + others + 256 * MiB))  # T6: ticks now
            dc = arb.enforcer.last.device
            assert dc is not None and held < dc.ceiling <= held + others + 256 * MiB
            stream = await arb.service.generate("a", p.Generate(request_id="r", prompt="tell me a story", max_tokens=3000))
            while not (handle.sample and handle.sample.running):
                await asyncio.sleep(0.01)
            mark = len(arb.enforcer.executed)
            start = time.monotonic()
            arb.pool.command(handle, p.Drill(rate=GiB, to=GiB))
            deadline = start + 20
            acted = []
            while time.monotonic() < deadline and not acted:
                await asyncio.sleep(0.01)
                acted = [(t, x) for t, x in list(arb.enforcer.executed)[mark:]
                         if isinstance(x, d.AbortWorkerRequests) and x.worker == handle.worker_id]
            arb.pool.command(handle, p.DrillStop())
            assert acted, "the guard never acted on the device pool"
            t, abort = acted[0]
            assert "device memory pressure" in abort.reason
            # 256 MiB of headroom at 1 GiB/s is ~0.25 s to the ceiling; a 1 s poll would be too late
            assert t - start < 1.0
            assert arb.enforcer.last.host_level == "ok"
            if not stream.done:
                arb.service.cancel(stream)

    asyncio.run(main())


def test_d5_a_load_refused_by_the_device_pool_names_it(tiny_models, runtime_dir):
    """A second model that does not fit the device ceiling is refused with 507
    naming the device pool, although host RAM has room for it. `thrash_hold = 0`: A3 as
    written, a busy model is no victim (with W5's holds on, the load would wait for it)."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="b", path=str(tiny_models.b))],
                         guard=GuardConfig(tier="custom", custom_ceiling=64 * GiB, hot_cache_max=0, thrash_hold=0))

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await _load_on_pretend_device(arb, "a")
            await arb.service.generate("a", p.Generate(request_id="r", prompt="hi", max_tokens=2000))  # busy: no victim
            while not (handle.sample and handle.sample.running):
                await asyncio.sleep(0.01)
            held = arb.enforcer.last.device_usage
            arb.service.update_guard(p.GuardUpdate(custom_device_ceiling=held + MiB))
            with pytest.raises(LoadError) as refused:
                await arb.models.load("b")
            assert refused.value.http_status == 507
            assert "device" in str(refused.value) and refused.value.code in ("insufficient_memory", "model_too_large")

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
            handle.set_device_info({"device_name": "NVIDIA H200", "architecture": "sm_90",
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
