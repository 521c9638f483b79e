"""A real supervisor with its HTTP front door, for the live front-door modules (no tests here).

The Arbiter must run in the main thread (it owns the signal handlers), so a
module-scoped server lives on an event loop that this thread drives: each
test hands its coroutine to `server.run(...)`, and the arbiter, uvicorn and
the workers' sockets progress while it runs. Clients are the real async
`openai` client and httpx, on the same loop.

The fixtures built on it (`server`, `token_server`, `no_front_door_errors`)
are in conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import psutil

from supervisor.arbiter import Arbiter
from supervisor.config import Config, GuardConfig, SupervisorConfig

ADMIN_TOKEN = "s3cret-admin-token"  # conftest's token_server wants it on /admin and /ui/session


def make_config(models, *, guard=None, **sup) -> Config:
    sup.setdefault("http", "0.0.0.0:0")  # all interfaces: lets a test knock from a non-loopback address
    sup.setdefault("heartbeat_interval", 0.5)
    sup.setdefault("heartbeat_timeout", 10.0)
    sup.setdefault("stop_grace", 3.0)
    # No spare worker (SPEC W1) unless a test asks: on a 2-core machine a spare's start is a
    # second of CPU beside what the test measures, and many tests count spawns, exits and workers.
    sup.setdefault("spare_workers", 0)
    # No prompt cache unless a test asks: these tests squeeze the ceiling to a few hundred
    # MiB and count bytes exactly; cached prompts would move the figures they compare.
    guard = guard or GuardConfig(hot_cache_max=0)
    return Config(guard=guard, supervisor=SupervisorConfig(**sup), models=models)


class LiveServer:
    def __init__(self, config: Config, runtime_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.arbiter = Arbiter(config, runtime_dir, max_workers=8, http=True)
        self.port = 0

    def __enter__(self) -> "LiveServer":
        self.task = self.loop.create_task(self.arbiter.run())
        self.run(self._listening(), timeout=30)
        self.port = int(self.arbiter.http_address.rsplit(":", 1)[1])
        return self

    async def _listening(self) -> None:
        while not getattr(self.arbiter, "http_address", None):
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self.arbiter.stop()
        self.loop.run_until_complete(asyncio.wait_for(self.task, 60))
        http = self.arbiter.http_server
        if http is not None and not http.task.done():  # uvicorn closes its connections
            self.loop.run_until_complete(asyncio.wait_for(http.task, 15))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def run(self, coro, timeout: float = 120):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}"

    def client(self, host: str = "127.0.0.1", **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url(host), timeout=kw.pop("timeout", 60), **kw)

    def openai(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url() + "/v1", api_key=kw.pop("api_key", "unused"),
                                  max_retries=0, **kw)

    def anthropic(self, **kw):
        import anthropic

        return anthropic.AsyncAnthropic(base_url=self.url(), api_key=kw.pop("api_key", "unused"),
                                        max_retries=0, **kw)


def front_door_errors(records) -> list[str]:
    """Errors the front door logged: each is a bug that a client saw as a 500."""
    return [r.getMessage() for r in records if r.name == "memvisor.http" and r.levelno >= logging.ERROR]


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than loopback (None when there is none)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


async def until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def parse_sse(text: str) -> list:
    """`data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as a string)."""
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
