"""SPEC D1 on a real NVIDIA GPU: what only a CUDA device can show.

Marked `gpu` and skipped without an NVIDIA device NVML can read (CI has
none): `scripts/h200_run.sh tests` runs them on a lent H200. Everything else
about the device pool runs here on the CPU (`test_d_device_live.py` with a
CUDA-shaped hello, the table tests).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import probe
from shared.probe import nvml
from supervisor.config import ModelConfig
from tests.arbiter_harness import Running, make_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
    pytest.mark.skipif(nvml.read_device() is None,
                       reason="no NVIDIA device NVML can read (needs a GPU, its driver, nvidia-ml-py and mlx-cuda)"),
]


def test_d1_a_cuda_worker_names_its_device_and_nvml_counts_its_bytes(tiny_models, runtime_dir):
    """The hello names the GPU; the supervisor's device figures are NVML's, per
    worker process; host usage (U1) is the footprint alone."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            assert probe.gpu_kind(handle.device_info) == "cuda", handle.device_info
            for _ in range(100):
                arb.wake()
                await asyncio.sleep(0.05)
                if handle.sample is not None:
                    break
            snap = arb.enforcer.snapshot(time.monotonic())
            reading = nvml.read_device(uuid=str(handle.device_info.get("uuid") or "") or None)
            assert reading is not None and snap.device_total == reading.total
            [record] = [w for w in snap.workers if w.worker == handle.worker_id]
            assert record.device_bytes == nvml.device_bytes_for(reading, handle.pid)
            assert record.device_bytes >= record.memory.mlx_active  # the CUDA context on top of MLX's arrays
            assert record.memory.usage == record.memory.footprint

    asyncio.run(main())


def test_m1_on_cuda_the_worker_holds_mlx_pool_to_its_cap_itself():
    """MLX's CUDA allocator is not bounded by its limits (../shared/device-cuda.md: a 10 GiB
    memory limit did not stop a 30 GiB allocation); the worker returns the pool at a step
    boundary when it is over `[guard] pool_max`. Here against the real allocator, in process:
    freed buffers fill the pool; after `hold_pool` it is within the cap, and a return is
    counted whenever the pool was over it (printed: whether set_cache_limit bounded it)."""
    import mlx.core as mx

    from shared.limits import Limits
    from shared.sizes import MiB
    from worker.allocator import AllocatorLimits

    cap = 64 * MiB
    alloc = AllocatorLimits(mx, platform="linux")
    alloc.apply(Limits(pool_max=cap))
    try:
        for size in (256, 512, 768):  # distinct sizes: each freed buffer stays in the pool
            block = mx.zeros((size * MiB // 4,), mx.float32)
            mx.eval(block)
            del block
        before = mx.get_cache_memory()
        freed = alloc.hold_pool()
        after = mx.get_cache_memory()
        print(f"pool {before / MiB:.0f} MiB with a {cap / MiB:.0f} MiB cache limit; "
              f"after hold_pool {after / MiB:.0f} MiB; returned {freed / MiB:.0f} MiB "
              f"({'set_cache_limit did not bound it' if before > cap else 'set_cache_limit bounded it'})")
        assert after <= cap
        assert alloc.pool_returns == (1 if before > cap else 0)
        assert freed >= (before - cap if before > cap else 0)
    finally:
        alloc.apply(Limits())  # MLX's own cache limit back for the rest of the process


def test_m1_on_cuda_a_worker_samples_its_pool_within_pool_max_and_counts_its_returns(tiny_models, runtime_dir):
    """Through a real worker on the GPU with a 16 MiB pool_max: every sample taken while it
    generates (written after the step boundary) shows MLX's pool within the cap, and the
    returns the worker made are in the sample status reads."""
    from shared import protocol as p
    from shared.sizes import MiB
    from supervisor.config import GuardConfig

    cap = 16 * MiB
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), max_concurrency=8)],
                         guard=GuardConfig(pool_max=cap))

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            streams = [await arb.service.generate("a", p.Generate(request_id=f"r{i}", prompt="word " * (40 + 30 * i),
                                                          max_tokens=400)) for i in range(6)]
            pools, returns = [], 0
            while not all(s.done for s in streams):
                sample = arb.ledger.read_sample(handle.slot)
                if sample is not None and sample.running:
                    pools.append(sample.memory.mlx_pool)
                    returns = max(returns, sample.memory.pool_returns)
                await asyncio.sleep(0.005)
            print(f"{len(pools)} samples while generating: pool at most {max(pools, default=0) / MiB:.1f} MiB "
                  f"(cap {cap / MiB:.0f} MiB); the worker returned its pool {returns} time(s)")
            assert pools and max(pools) <= cap

    asyncio.run(main())
