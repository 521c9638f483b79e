"""Issue 21: the supervisor's one loop never waits on the disk, and a stall of
the loop never kills healthy workers. Real worker processes, real ZeroMQ."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_supervisor_live import Running, collect, make_config

from shared import protocol as p
from supervisor.config import ModelConfig

pytestmark = pytest.mark.slow


def test_issue21_a_loop_stall_longer_than_the_heartbeat_window_kills_no_worker(tiny_models, runtime_dir):
    """Before: the loop blocked 2.5 s against a 1 s window; at its next beat every
    worker, the pinned one included, was killed as wedged."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True),
                          ModelConfig(id="b", path=str(tiny_models.b))],
                         heartbeat_interval=0.2, heartbeat_timeout=1.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            a = await arb.load("a")
            b = await arb.load("b")
            await asyncio.sleep(0.5)
            time.sleep(2.5)  # the loop itself is stalled (as a slow rescan on it did)
            await asyncio.sleep(2.0)  # several beats after it
            assert arb.pool.counters["wedged"] == 0, [e.reason for e in arb.events if e.kind == "wedged"]
            assert a.live and b.live and a.pid and b.pid
            assert any(e.kind == "stall" for e in arb.events)
            stream = await arb.generate("a", p.Generate(request_id="after", prompt="hi", max_tokens=2))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished), end

    asyncio.run(main())
