"""Routing signals from both ends: a real supervisor with a real worker, and
a router-style client that reads the signals with the OpenAI SDK and httpx.

- a model with max_concurrency 1 and max_queue 1: the third request in flight is a
  429 `model_at_capacity` with Retry-After (the SDK's RateLimitError), while
  /health?model=ID says `saturated` and /metrics counts one running, one queued;
- a request that will not wait (`X-Memvisor-Max-Wait: 0`) for a model still loading
  gets a 503 `model_loading` with the load's progress; the router waits Retry-After
  and polls /health?model=ID until it is 200, while a plain request meanwhile waits
  for the load as it always has;
- a SIGSTOPped worker reads `unresponsive` and refuses a request that will not wait.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config, metric
from worker.main import LOAD_DELAY_ENV, STEP_DELAY_ENV

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

CHAT = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
NO_WAIT = {"x-memvisor-max-wait": "0"}


@pytest.fixture
def live(tiny_models, tmp_path_factory, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_ENV, "0.3")  # each engine step: a request takes seconds
    monkeypatch.setenv(LOAD_DELAY_ENV, "3.0")  # and a load long enough to be seen loading
    models = [ModelConfig(id="a", path=str(tiny_models.a), max_concurrency=1, max_queue=1)]
    config = make_config(models, host_name="edge-1", heartbeat_interval=0.3, heartbeat_timeout=4.0)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as server:
        yield server


def test_429_past_max_concurrency_and_max_queue_read_by_the_sdk_and_the_gauges(live):
    async def main():
        client = live.openai()  # max_retries=0: the refusal itself
        async with live.client() as c:
            await c.post("/v1/models/a/load")
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            second = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
            await asyncio.sleep(0.8)  # both reached the worker: one runs, one waits
            health = await c.get("/health", params={"model": "a"})
            metrics = (await c.get("/metrics")).text
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(**CHAT)
            served = [await first, await second]
        return health, metrics, refused.value, served

    health, metrics, refused, served = live.run(main())
    assert health.status_code == 429 and health.headers["retry-after"] == "1"
    assert {k: health.json()[k] for k in ("state", "running", "queued", "code")} == {
        "state": "saturated", "running": 1, "queued": 1, "code": "model_at_capacity"}
    assert metric(metrics, "memvisor_model_running_requests", model="a") == 1
    assert metric(metrics, "memvisor_model_queued_requests", model="a") == 1
    assert metric(metrics, "memvisor_model_ready", model="a") == 0
    assert refused.status_code == 429 and refused.response.headers["retry-after"] == "1"
    assert refused.body["code"] == "model_at_capacity" and refused.response.headers["x-memvisor-host"] == "edge-1"
    worker = live.arbiter.pool.worker_for("a").worker_id
    for r in served:  # the two admitted ones were served, and say by whom
        assert r.status_code == 200, r.text
        assert r.headers["x-memvisor-host"] == "edge-1" and r.headers["x-memvisor-worker"] == worker


def test_a_request_that_will_not_wait_for_a_load_gets_503_with_progress_then_polls_until_ready(live):
    async def main():
        async with live.client() as c:
            started = time.monotonic()
            refused = await c.post("/v1/chat/completions", json=CHAT, headers=NO_WAIT)
            refused_after = time.monotonic() - started
            plain = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))  # no header: waits
            await asyncio.sleep(1.5)
            during = await c.get("/health", params={"model": "a"})
            polls = 0
            while True:  # the router's side: wait Retry-After, ask again
                health = await c.get("/health", params={"model": "a"})
                if health.status_code == 200:
                    break
                polls += 1
                assert health.status_code == 503 and health.json()["state"] in ("loading", "busy", "ready")
                await asyncio.sleep(min(float(health.headers["retry-after"]), 1.0))
                assert time.monotonic() - started < 90
            return refused, refused_after, during, await plain, polls

    refused, refused_after, during, plain, polls = live.run(main())
    assert refused.status_code == 503 and refused_after < 2.5, refused_after
    error = refused.json()["error"]
    assert error["code"] == "model_loading" and int(refused.headers["retry-after"]) >= 1
    assert error["progress"]["state"] in ("queued", "starting", "loading")
    assert error["progress"]["elapsed"] >= 0 and "estimate_bytes" in error["progress"]
    assert during.status_code == 503 and during.json()["state"] == "loading" and polls >= 1
    progress = during.json()["progress"]
    assert progress["state"] in ("starting", "loading") and progress["elapsed"] > 1.0
    assert progress["estimate_bytes"] > 0
    assert plain.status_code == 200, plain.text  # a plain client waited for the load, as before


def test_a_sigstopped_worker_reads_unresponsive_and_refuses_a_request_that_will_not_wait(live):
    async def main():
        async with live.client() as c:
            await c.post("/v1/models/a/load")
            pid = live.arbiter.pool.worker_for("a").pid
            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                while True:
                    health = await c.get("/health", params={"model": "a"})
                    if health.status_code != 200 or time.monotonic() - started > 3.5:
                        break
                    await asyncio.sleep(0.2)
                refused = await c.post("/v1/chat/completions", json=CHAT, headers=NO_WAIT)
            finally:
                os.kill(pid, signal.SIGCONT)
            return health, refused

    health, refused = live.run(main())
    assert health.status_code == 503 and health.json()["state"] == "unresponsive", health.json()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_unresponsive"
    assert int(refused.headers["retry-after"]) >= 1
