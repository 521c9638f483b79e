"""SPEC U1 across the wire: the sample a real worker writes to the ledger counts its MLX pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import probe
from shared import protocol as p
from supervisor.config import ModelConfig
from tests.arbiter_harness import Running, collect, make_config

pytestmark = pytest.mark.slow


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
