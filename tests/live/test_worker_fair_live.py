"""Fair prefill with real processes: a short prompt sent while a long one prefills gets its first token
before the long one's, through the front door and a real worker, and every reply is token-identical to
the same request alone; the prompt cache still feeds a request that repeats the long prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from shared.sizes import MiB
from supervisor.config import GuardConfig, ModelConfig
from tests.http_harness import LiveServer, make_config, until

pytestmark = pytest.mark.slow

LONG = "The river bends toward the hills and the keeper opens the doors. " * 140
SHORT = "Once upon a time"


@pytest.fixture(scope="module")
def slower(tmp_path_factory) -> Path:
    """A 64 MiB float32 model: its prefill of the long prompt takes many short turns (the tiny
    models prefill it in a few, before the short request has arrived)."""
    from modelfiles.modelgen import make_model

    path = tmp_path_factory.mktemp("models") / "slower"
    make_model(path, 64 * MiB, 3, dtype="float32")
    return path


@pytest.fixture(scope="module", params=["shortest", "round_robin"])
def server(request, slower, tmp_path_factory):
    models = [ModelConfig(id="m", path=str(slower), pinned=True, max_concurrency=4)]
    # short prefill turns, so the long prompt takes many; a prompt cache (H1) to reuse
    config = make_config(models, guard=GuardConfig(hot_cache_max=64 * MiB), chunk_seconds=0.02,
                         prefill_order=request.param)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        live.run(until(lambda: (w := live.arbiter.pool.worker_for("m")) is not None
                       and w.state in ("ready", "busy"), timeout=60, what="model loaded"))
        yield live


async def _stream(c, prompt: str, tokens: int, after=None) -> dict:
    if after is not None:
        await until(after, timeout=60, what="the long prompt prefilling")
    text = ""
    usage = {}
    async with c.stream("POST", "/v1/completions", json={
            "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"]:
                text += event["choices"][0]["text"]
            if event.get("usage"):
                usage = event["usage"]
    return {"text": text, "usage": usage}


def test_fair_prefill_a_short_prompt_is_served_while_a_long_one_prefills_and_replies_stay_identical(server,
                                                                                                     monkeypatch):
    streams = server.arbiter.pool.streams
    opened: list = []  # every request's stream in order; `first_token`: when its first token reached the supervisor
    open_ = streams.open

    def recording(*args):
        opened.append(open_(*args))
        return opened[-1]

    monkeypatch.setattr(streams, "open", recording)

    def long_prefilling() -> bool:  # its worker said Prompted: the prefill has started
        return any(s.prompted is not None and s.prompted.prompt_tokens > 500 for s in streams.by_id.values())

    order = server.arbiter.config.supervisor.prefill_order  # new prompts for each server (its disk tier)

    async def main():
        async with server.client() as c:
            long_, short = await asyncio.gather(_stream(c, f"B {order} {LONG}", 12),
                                                _stream(c, SHORT + " ", 12, after=long_prefilling))
            again = await _stream(c, f"B {order} {LONG}", 12)
            return long_, short, again

    long_, short, again = server.run(main(), timeout=300)
    assert long_["usage"]["prompt_tokens"] > 2000
    short_stream, long_stream = sorted(opened[:2], key=lambda stream: stream.prompted.prompt_tokens)
    assert short_stream.first_token is not None and long_stream.first_token is not None
    assert short_stream.first_token < long_stream.first_token, (
        "the short one waited for the long one's prefill: sent, first token (s) "
        f"{[(s.created - long_stream.created, (s.first_token or 0) - long_stream.created) for s in opened]}")
    plain = server.run(_plain(server, f"B {order} {LONG}", SHORT + " "))
    assert long_["text"] == plain[0] and short["text"] == plain[1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 500, "H1 fed the repeat"
    assert again["text"] == long_["text"]


async def _plain(server, *prompts: str) -> list[str]:
    """Each prompt alone, guessing nothing (the reference replies)."""
    out = []
    async with server.client() as c:
        for prompt in prompts:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "speculative": False})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
    return out
