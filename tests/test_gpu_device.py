"""SPEC D1 on a real NVIDIA GPU: what only a CUDA device can show.

Marked `gpu` and skipped without an NVIDIA device NVML can read (CI has
none): `scripts/h200_run.sh tests` runs them on a lent H200. Everything else
about the device pool runs here on the CPU (`test_device_live.py` with a
CUDA-shaped hello, the table tests).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_supervisor_live import Running, make_config

from shared import probe
from shared.probe import nvml
from supervisor.config import ModelConfig

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
