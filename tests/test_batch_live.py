"""Issue 11 with real processes: concurrent streams through the front door, one worker
decoding them as a batch, each stream token-identical to the same request alone."""

from __future__ import annotations

import asyncio

import pytest
from test_http_harness import LiveServer, make_config, parse_sse, until

from supervisor.config import ModelConfig

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "def main():", "The memory guard watches every model and steps in early.",
           "x", "A worker holds one model; the supervisor holds the workers.", "Story 6: the river"]
TOKENS = [24, 10, 18, 30, 6, 20]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    models = [ModelConfig(id="m", path=str(tiny_models.a), pinned=True, max_concurrency=8)]
    with LiveServer(make_config(models), tmp_path_factory.mktemp("rt")) as live:
        live.run(until(lambda: (w := live.arbiter.pool.worker_for("m")) is not None
                       and w.state in ("ready", "busy"), timeout=60, what="model loaded"))
        yield live


async def _stream(c, i: int, delay: float = 0.0, max_tokens: int | None = None) -> tuple[str, int]:
    await asyncio.sleep(delay)
    r = await c.post("/v1/completions", json={
        "model": "m", "prompt": PROMPTS[i], "max_tokens": max_tokens or TOKENS[i], "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    return text, events[-2]["usage"]["completion_tokens"]


def test_concurrent_streams_joining_at_different_times_match_each_request_alone(server):
    streams = server.arbiter.pool.streams

    async def main():
        async with server.client() as c:
            alone = [await _stream(c, i) for i in range(len(PROMPTS))]
            before = streams.batches
            together = await asyncio.gather(*(_stream(c, i, delay=0.05 * i) for i in range(len(PROMPTS))))
            return alone, together, streams.batches - before

    alone, together, batches = server.run(main())
    assert together == alone
    assert batches > 0, "the worker never sent a step's tokens for several streams in one frame"


def test_a_stream_that_leaves_mid_batch_is_aborted_and_the_others_stay_identical(server):
    worker = server.arbiter.pool.worker_for("m")

    async def leaver(c):
        async with c.stream("POST", "/v1/completions", json={
                "model": "m", "prompt": PROMPTS[0], "max_tokens": 100_000, "temperature": 0,
                "stream": True}) as r:
            got = 0
            async for _line in r.aiter_lines():
                got += 1
                if got > 10:
                    return

    async def main():
        async with server.client() as c:
            alone = [await _stream(c, i, max_tokens=40) for i in (1, 2)]
            together = await asyncio.gather(_stream(c, 1, max_tokens=40), leaver(c),
                                            _stream(c, 2, delay=0.1, max_tokens=40))
            await until(lambda: not server.arbiter.pool.running(worker), timeout=10, what="every stream closed")
            return alone, [together[0], together[2]]

    alone, together = server.run(main())
    assert together == alone
