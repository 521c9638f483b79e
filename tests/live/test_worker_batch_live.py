"""Batched decode with real processes: concurrent streams through the front door, one worker
decoding them as a batch, each stream token-identical to the same request alone."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config, metric, parse_sse, until

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


def test_status_ps_and_metrics_show_where_the_decode_batch_memory_goes(server):
    """The worker writes its decode batch's buffers, the live KV in them and its relayouts into
    its memory sample; status, ps (the models in /status) and /metrics show them. Checked against
    the model's own KV size: the live bytes are whole tokens of KV (2 layers x K and V x 1 head
    x 64 x float16 = 512 bytes a token), no more than the streams' prompts and replies hold, and
    never above the buffers; the buffers are whole 32-position steps of rows. Once the streams
    ended the buffers are gone and the relayouts stay."""
    from supervisor.cli.status import render
    from supervisor.policy.status import ServerStatus

    per_token, streams, tokens = 512, 4, 300
    seen: dict = {}

    async def watch(c, running):
        while not running.done():
            server.arbiter.wake()  # a fresh tick: status is built from the last one
            status = (await c.get("/status")).json()
            [w] = [w for w in status["guard"]["workers"] if w["model"] == "m"]
            [info] = [m for m in status["models"] if m["id"] == "m"]
            if w["batch_bytes"] and info["batch_bytes"]:
                seen.update(worker=w, info=info, metrics=(await c.get("/metrics")).text, status=status)
                return
            await asyncio.sleep(0.02)

    async def main():
        async with server.client() as c:
            running = asyncio.gather(*(_stream(c, i, max_tokens=tokens) for i in range(streams)))
            await watch(c, running)
            await running
            await until(lambda: server.arbiter.pool.worker_for("m").sample.memory.batch_bytes == 0,
                        timeout=10, what="the batch's buffers to go with its last row")
            server.arbiter.wake()
            await asyncio.sleep(0.3)
            return (await c.get("/status")).json()

    after = server.run(main())
    assert seen, "status never showed a decode batch while the streams ran"
    for figures in (seen["worker"], seen["info"]):
        live, held = figures["batch_live_bytes"], figures["batch_bytes"]
        assert 0 < live <= held and live % per_token == 0
        assert live // per_token <= streams * (tokens + 16)  # prompts are a few tokens each
        assert held % (32 * per_token) == 0
    assert seen["worker"]["batch_relayouts"] >= 1  # the buffers were laid out at least once
    for name in ("memvisor_worker_batch_bytes", "memvisor_worker_batch_live_bytes"):
        assert metric(seen["metrics"], name, model="m") > 0, name
    assert metric(seen["metrics"], "memvisor_worker_batch_relayouts_total", model="m") >= 1
    assert "decode batches (buffers as allocated, live KV in them):" in render(
        msgspec.json.decode(msgspec.json.encode(seen["status"]), type=ServerStatus))
    [w] = [w for w in after["guard"]["workers"] if w["model"] == "m"]
    assert w["batch_bytes"] == w["batch_live_bytes"] == 0
    assert w["batch_relayouts"] >= seen["worker"]["batch_relayouts"]
