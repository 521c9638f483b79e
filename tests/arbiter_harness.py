"""An Arbiter running inside the test's own event loop, so a test can reach in and wait
for exact states, with heartbeats quick enough that wedges are found in seconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shared import protocol as p
from supervisor.arbiter import Arbiter
from supervisor.config import Config
from tests.http_harness import make_config as harness_config


def make_config(models, **sup) -> Config:
    """The front door tests' config, with quicker heartbeats (wedges are tested here)."""
    sup.setdefault("heartbeat_interval", 0.2)
    sup.setdefault("heartbeat_timeout", 2.0)
    return harness_config(models, **sup)


class Running:
    """An Arbiter running as a task of the test's loop."""

    def __init__(self, config: Config, runtime_dir: Path) -> None:
        self.arbiter = Arbiter(config, runtime_dir, max_workers=8, http=False)

    async def __aenter__(self) -> Arbiter:
        self.task = asyncio.get_running_loop().create_task(self.arbiter.run())
        for _ in range(200):
            if self.arbiter.running:
                return self.arbiter
            await asyncio.sleep(0.01)
        raise RuntimeError("arbiter did not start")

    async def __aexit__(self, *exc) -> None:
        self.arbiter.stop()
        await asyncio.wait_for(self.task, 30)


async def collect(stream) -> tuple[str, object]:
    text = []
    while True:
        msg = await asyncio.wait_for(stream.queue.get(), 60)
        if isinstance(msg, p.TokenOut):
            text.append(msg.text)
        else:
            return "".join(text), msg
