"""SPEC P9 across real processes: the enforcer ticks at the cadence `status` reports, not on
every heartbeat, and an event wakes it at once (the lab scenarios in
tests/live/test_p_lab_live.py cover G1, P6 at hard with a stop under way, and P6.3)."""

from __future__ import annotations

import asyncio

import pytest

from shared import protocol as p
from supervisor.config import ModelConfig
from tests.arbiter_harness import Running, collect, make_config

pytestmark = pytest.mark.slow


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
