"""The OpenAI-compatible front door with real workers (real MLX on the CPU).

One supervisor serves the whole module (start-ups are what cost time): a
pinned model and two on-demand ones. Tests that squeeze the guard through
`POST /admin/guard` (SPEC T6) put it back as they found it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import openai
import pytest

from shared import protocol as p
from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config, metric, parse_sse, until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

CHAT = [{"role": "user", "content": "Say something."}]
LONG = 100_000  # tokens: a generation that outlives any test unless aborted


def long_context(model: Path, target: Path, tokens: int = 1_000_000) -> Path:
    """A copy of `model` whose config.json claims a context of `tokens` (its rotary
    embeddings do not mind): these tests need 40k-token prompts (G1) and
    generations that outlive them, which the context check (prompt + max_tokens) refuses on the
    tiny model's 4,096 tokens."""
    shutil.copytree(model, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = tokens
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    a, b = long_context(tiny_models.a, root / "a"), long_context(tiny_models.b, root / "b")
    models = [
        ModelConfig(id="pin", path=str(a), pinned=True),
        ModelConfig(id="a", path=str(a)),
        ModelConfig(id="b", path=str(b)),
    ]
    # queue_size 1: the second request waiting under pressure is turned away (P3's bound)
    config = make_config(models, queue_size=1, max_tokens=LONG)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        live.health = live.run(_health_while_pinned_loads(live))
        yield live


async def _health_while_pinned_loads(live):
    """/health right after start (the pinned model is loading), then once it is ready."""
    async with live.client() as c:
        first = await c.get("/health")
        await until(lambda: (w := live.arbiter.pool.worker_for("pin")) is not None
                    and w.state in ("ready", "busy"), what="pinned model loaded")
        return first, await c.get("/health")


def relax_guard(server) -> None:
    server.arbiter.enforcer.update_guard(p.GuardUpdate(tier="balanced", custom_ceiling=0))


async def squeeze(c, usage_fraction: float) -> int:
    """Custom ceiling such that the current usage sits at `usage_fraction` of it (custom
    tier: soft 0.90, hard 0.97, SPEC T4). Returns the ceiling."""
    usage = (await c.get("/status")).json()["guard"]["usage"]
    ceiling = int(usage / usage_fraction)
    r = await c.post("/admin/guard", json={"tier": "custom", "custom_ceiling": ceiling})
    assert r.status_code == 200, r.text
    return ceiling


def test_health_is_503_until_the_pinned_model_is_loaded(server):
    first, later = server.health  # taken by the fixture as the server started
    assert first.status_code == 503
    assert first.json()["status"] == "loading" and "pin" in first.json()["waiting"]
    assert later.status_code == 200 and later.json()["status"] == "ok"


def test_chat_streamed_chat_and_completions_with_the_openai_client(server):
    async def main():
        client = server.openai()
        whole = await client.chat.completions.create(model="pin", messages=CHAT, max_tokens=12, temperature=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="pin", messages=CHAT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        text = await client.completions.create(model="pin", prompt="Once upon", max_tokens=6, temperature=0)
        streamed_text = [c async for c in await client.completions.create(
            model="pin", prompt="Once upon", max_tokens=6, temperature=0, stream=True)]
        async with server.client() as c:
            metrics = (await c.get("/metrics")).text
        return whole, chunks, text, streamed_text, metrics

    whole, chunks, text, streamed_text, metrics = server.run(main())
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    # streamed: role first, then content, then the finish, then usage alone (include_usage)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed == whole.choices[0].message.content  # greedy: the same tokens, none lost
    assert text.object == "text_completion" and text.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in streamed_text) == text.choices[0].text
    assert streamed_text[-1].choices[0].finish_reason == "length"
    # every generation counted where it happened: first tokens, tokens, outcomes
    assert metric(metrics, "memvisor_time_to_first_token_seconds_count", model="pin") >= 4
    assert metric(metrics, "memvisor_generated_tokens_total", model="pin") >= 12 + 12 + 6 + 6
    assert metric(metrics, "memvisor_generations_total", model="pin", outcome="finished") >= 4
    assert metric(metrics, "memvisor_worker_usage_bytes", model="pin") > 0


def test_sse_wire_format_ends_with_done(server):
    async def main():
        async with server.client() as c:
            return await c.post("/v1/chat/completions", json={
                "model": "pin", "messages": CHAT, "max_tokens": 3, "stream": True})

    r = server.run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "usage" not in events[0]  # only with stream_options.include_usage


def test_model_list_load_and_unload(server):
    async def main():
        async with server.client() as c:
            loaded = await c.post("/v1/models/a/load")
            listed = (await c.get("/v1/models")).json()
            pid = loaded.json()["pid"]
            unloaded = await c.post("/v1/models/a/unload")
            again = await c.post("/v1/models/a/unload")
            after = (await c.get("/v1/models/a")).json()
            return loaded, listed, pid, unloaded, again, after

    loaded, listed, pid, unloaded, again, after = server.run(main())
    assert loaded.status_code == 200 and loaded.json()["state"] in ("ready", "busy") and pid > 0
    states = {m["id"]: (m["state"], m["pinned"]) for m in listed["data"]}
    assert listed["object"] == "list" and states["a"][0] in ("ready", "busy") and states["pin"][1] is True
    assert states["b"] == ("unloaded", False)
    assert unloaded.json() == {"id": "a", "unloaded": True, "object": "model"}
    assert again.json()["unloaded"] is False
    assert after["state"] == "unloaded" and after["pid"] is None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_a2_on_demand_load_evicts_the_idle_lru_model_under_a_small_custom_ceiling(server):
    """A request for an unloaded model loads it on demand; when it does not fit under the
    evict target, the least recently used idle non-pinned model makes room (SPEC A1/A2)."""

    async def main():
        async with server.client() as c:
            r = await c.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200, r.text
            a_worker = server.arbiter.pool.worker_for("a")
            await until(lambda: a_worker.sample is not None, what="a sample from a")
            server.arbiter.wake()
            await asyncio.sleep(0.3)
            # usage between soft (0.90) and hard (0.97): nothing is evicted until b needs room
            await squeeze(c, 0.935)
            try:
                assert a_worker.state in ("ready", "busy")
                r = await c.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
                metrics = (await c.get("/metrics")).text
            finally:
                relax_guard(server)
            return r, a_worker, metrics

    r, a_worker, metrics = server.run(main())
    assert r.status_code == 200, r.text
    assert a_worker.state == "stopped"
    assert server.arbiter.pool.worker_for("b") is not None
    evictions = [e for e in server.arbiter.events if e.kind == "evict" and e.model_id == "a"]
    assert evictions and "to make room for b" in evictions[-1].reason
    assert metric(metrics, "memvisor_guard_events_total", kind="evict") >= 1


def test_g1_prefill_that_cannot_fit_is_400_even_when_streamed(server):
    """SPEC G1: a prompt whose prefill would push the group over the hard limit is the
    client's to shorten: 400 `prefill_memory_exceeded` with the figures, never a crash
    and never a 200 stream that dies. The SSE response only starts after the first
    token, so a streamed request gets the same status."""
    prompt = "memory " * 40_000  # 40k tokens: KV alone is ~26 MB, plus one chunk's activations

    async def main():
        async with server.client() as c:
            for model in ("a", "b"):  # nothing idle that G1's eviction could stop to make room
                await c.post(f"/v1/models/{model}/unload")
            try:
                # Usage at 75% of the ceiling: a headroom of a third of usage, well under the
                # prompt's estimated prefill peak (usage + peak ~1.4x the hard limit), yet wide
                # enough for what tokenizing 40k tokens holds for a moment (~30 MiB on a
                # ~155 MiB group: at 7% headroom two ticks over the ceiling on a loaded machine
                # made it an emergency, a 503, before the worker could refuse). The first
                # refusal grows the worker once: squeeze again from that plateau.
                await squeeze(c, 0.75)
                first = await c.post("/v1/completions", json={"model": "pin", "prompt": prompt, "max_tokens": 2})
                await squeeze(c, 0.75)
                whole = await c.post("/v1/completions", json={"model": "pin", "prompt": prompt, "max_tokens": 2})
                with pytest.raises(openai.BadRequestError) as streamed:
                    await server.openai().completions.create(model="pin", prompt=prompt, max_tokens=2,
                                                             stream=True)
            finally:
                relax_guard(server)
            after = await c.post("/v1/completions", json={"model": "pin", "prompt": "short", "max_tokens": 2})
        return first, whole, streamed.value, after

    first, whole, streamed, after = server.run(main())
    assert first.status_code == 400, first.text
    assert whole.status_code == 400, whole.text
    error = whole.json()["error"]
    assert error["code"] == "prefill_memory_exceeded" and error["binding"]
    assert error["estimated_bytes"] > error["limit_bytes"] > 0
    assert streamed.code == "prefill_memory_exceeded"
    assert after.status_code == 200  # the worker lives on


def test_client_disconnect_mid_stream_aborts_the_request_in_the_worker(server):
    """A reader who left must not keep a worker generating (and holding KV memory)."""
    arb = server.arbiter

    async def main():
        worker = arb.pool.worker_for("pin")
        async with server.client() as c:
            async with c.stream("POST", "/v1/chat/completions", json={
                    "model": "pin", "messages": CHAT, "max_tokens": LONG, "temperature": 0, "stream": True}) as r:
                got = 0
                async for _line in r.aiter_lines():
                    got += 1
                    if got > 20:
                        break
            # the response is closed: the connection is gone
        await until(lambda: not arb.pool.running(worker), timeout=10, what="the stream forgotten")
        await until(lambda: worker.sample is not None and worker.sample.running == 0, timeout=10,
                    what="the worker running nothing")
        tokens = worker.sample.tokens
        await asyncio.sleep(1.0)
        arb.pool.read_samples()
        return worker, tokens

    worker, tokens = server.run(main())
    assert worker.sample.tokens == tokens  # generation really stopped
    assert tokens < LONG


def test_client_disconnect_during_a_whole_completion_aborts_it_too(server):
    """Not only streams: a client that gives up on a non-streamed answer frees the worker."""
    arb = server.arbiter

    async def main():
        worker = arb.pool.worker_for("pin")
        async with server.client() as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json={
                "model": "pin", "prompt": "x", "max_tokens": LONG, "temperature": 0}))
            await until(lambda: arb.pool.running(worker), timeout=10, what="the request running")
            await asyncio.sleep(0.5)
            call.cancel()  # httpx closes the connection
        await until(lambda: not arb.pool.running(worker), timeout=10, what="the stream forgotten")
        await until(lambda: worker.sample is not None and worker.sample.running == 0, timeout=10,
                    what="the worker running nothing")
        return worker.sample.tokens

    assert server.run(main()) < LONG


def test_p3_requests_queue_during_pressure_and_are_released_when_it_ends(server):
    """While the level is not ok new requests wait in a bounded queue and requests already
    running continue; past the bound a request gets 503 with Retry-After; a client that
    leaves the queue is dropped from it; when pressure ends the queue is released (SPEC P3)."""
    arb = server.arbiter
    queued_chat = {"model": "pin", "messages": CHAT, "max_tokens": 4, "temperature": 0}

    async def main():
        client = server.openai()
        async with server.client() as c:
            running = await client.chat.completions.create(model="pin", messages=CHAT, max_tokens=LONG,
                                                           temperature=0, stream=True)
            first = await running.__anext__()
            assert first.choices[0].delta.role == "assistant"
            await squeeze(c, 0.935)
            try:
                await until(lambda: arb.enforcer.admission_paused, timeout=10, what="admission paused")
                leaver = asyncio.ensure_future(c.post("/v1/chat/completions", json=queued_chat))
                await until(lambda: arb.gate.depth == 1, timeout=10, what="the first request queued")
                leaver.cancel()
                await until(lambda: arb.gate.depth == 0, timeout=10, what="the leaver dropped from the queue")
                queued = asyncio.ensure_future(client.chat.completions.create(**queued_chat))
                await until(lambda: arb.gate.depth == 1, timeout=10, what="the request queued")
                turned_away = await c.post("/v1/chat/completions", json=queued_chat)
                depth = metric((await c.get("/metrics")).text, "memvisor_queue_depth")
                before = time.monotonic()
                await asyncio.sleep(1.5)
                assert not queued.done(), "a queued request ran while admission was paused"
                streamed = 0
                async for _chunk in running:  # the running request kept going all along
                    streamed += 1
                    if streamed >= 5:
                        break
            finally:
                relax_guard(server)
            answer = await asyncio.wait_for(queued, 30)
            waited = time.monotonic() - before
            await running.close()
        return depth, turned_away, answer, waited, streamed

    depth, turned_away, answer, waited, streamed = server.run(main())
    assert depth == 1
    assert turned_away.status_code == 503 and int(turned_away.headers["retry-after"]) >= 1
    assert turned_away.json()["error"]["code"] == "overloaded"
    assert answer.usage.completion_tokens == 4
    assert waited >= 1.5 and streamed == 5
    assert arb.gate.depth == 0


def test_worker_crash_mid_stream_ends_the_stream_with_an_error_event(server):
    """A worker killed mid-generation (say, by the OOM killer) must not look like a
    short but complete answer: the stream carries an error event the SDK raises.
    Runs last: the pinned model is respawned afterwards."""
    import os
    import signal

    async def main():
        worker = server.arbiter.pool.worker_for("pin")
        stream = await server.openai().chat.completions.create(model="pin", messages=CHAT, max_tokens=LONG,
                                                              temperature=0, stream=True)
        got = 0
        with pytest.raises(openai.APIError) as err:
            async for _chunk in stream:
                got += 1
                if got == 10:
                    os.kill(worker.pid, signal.SIGKILL)
        await until(lambda: (w := server.arbiter.pool.worker_for("pin")) is not None and w is not worker
                    and w.state in ("ready", "busy"), what="the pinned model respawned")
        return err.value, got

    error, got = server.run(main())
    assert got >= 10
    assert error.body["code"] == "worker_exited" and "SIGKILL" in error.message
