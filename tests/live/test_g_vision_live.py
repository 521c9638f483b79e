"""G1 for images, end to end: an image whose vision tower cannot fit beside an idle model evicts it.

Real supervisor, real workers, real HTTP. The vision model's tower is made heavy on purpose (a 512-pixel
tile, eight heads: ~50 MiB of attention scores and activations),
so the image's prefill peak is the tower's, far above its text. Under a custom ceiling that puts the
hard limit 40 % of that peak short of usage + peak, the worker's preflight asks for the shortfall,
the supervisor stops the idle model, and the image is answered; with no room to be had it is a 400
with the figures, never an OOM. `hot_cache_max = 0`, so the limits are the ceiling's alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config, until
from tests.image_harness import data_url, image_bytes
from worker import vision_cost

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

HARD = 0.97  # the custom tier's hard fraction (SPEC T4)
HEAVY = ("VisionDims(hidden=128, layers=2, intermediate=256, heads=2, kv_heads=1, vision_hidden=128, vision_layers=2, "
         "vision_intermediate=256, vision_heads=8, patch=16, tile=512, scale=4, tiles=1)")
TILES = 1  # no split: the whole image is one tile
PICTURE = image_bytes(300, 300, seed=2)


@pytest.fixture(scope="module")
def live(tiny_models, tmp_path_factory):
    heavy = tmp_path_factory.mktemp("vision-live") / "heavy-vlm"
    subprocess.run([sys.executable, "-c", "from modelfiles.vlmgen import VisionDims, make_vision_model; "
                    f"make_vision_model({str(heavy)!r}, {HEAVY}, seed=3)"], check=True, capture_output=True)
    # the vision model pinned: pressure never stops it, only the idle model can make room
    models = [ModelConfig(id="idle", path=str(tiny_models.a)), ModelConfig(id="eyes", path=str(heavy), pinned=True)]
    with LiveServer(make_config(models), tmp_path_factory.mktemp("rt")) as server:
        server.heavy = heavy
        yield server


def tower_peak(live) -> int:
    """What the worker's G1 counts for the image before any tower ran: the prior over its tiles."""
    config = json.loads((live.heavy / "config.json").read_text())
    return vision_cost.peak(vision_cost.prior(config, 4), TILES)


def ask(c, timeout: float = 120):
    return c.post("/v1/chat/completions", timeout=timeout, json={
        "model": "eyes", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(PICTURE)}}, {"type": "text", "text": "What?"}]}]})


async def _both_loaded(live, c):
    for model in ("idle", "eyes"):  # eyes with text: its tower has not run (the estimate is the prior)
        r = await c.post("/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    idle = live.arbiter.pool.worker_for("idle")
    await until(lambda: idle.sample is not None and idle.sample.memory.usage > 0, what="the idle model's usage")
    return idle


def test_g1_an_image_whose_tower_cannot_fit_beside_an_idle_model_evicts_it_and_is_answered(live):
    peak = tower_peak(live)

    async def main():
        async with live.client() as c:
            idle = await _both_loaded(live, c)
            usage = (await c.get("/status")).json()["guard"]["usage"]
            assert idle.sample.memory.usage > 0.4 * peak, "stopping the idle model would not cover the shortfall"
            ceiling = int((usage + 0.6 * peak) / HARD)  # short by 40 % of the tower's peak
            assert usage < 0.9 * ceiling, "usage over soft: the supervisor would stop the idle model on its own"
            r = await c.post("/admin/guard", json={"tier": "custom", "custom_ceiling": ceiling})
            assert r.status_code == 200, r.text
            try:
                served = await ask(c)
            finally:
                await c.post("/admin/guard", json={"tier": "balanced", "custom_ceiling": 0})
            return served, idle

    served, idle = live.run(main(), timeout=300)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] >= TILES * 64  # the image's tokens were prefilled
    assert idle.state == "stopped"
    evictions = [e for e in live.arbiter.events if e.kind == "evict" and e.model_id == "idle"]
    assert evictions and "prefill of" in evictions[-1].reason  # the worker's request for room, not pressure


def test_g1_an_image_that_cannot_fit_at_all_is_a_400_with_the_figures(live):
    peak = tower_peak(live)

    async def main():
        async with live.client() as c:
            r = await c.post("/v1/chat/completions", json={"model": "eyes", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            usage = (await c.get("/status")).json()["guard"]["usage"]
            ceiling = int((usage + 0.1 * peak) / HARD)  # not even this worker alone has room for the tower
            r = await c.post("/admin/guard", json={"tier": "custom", "custom_ceiling": ceiling})
            assert r.status_code == 200, r.text
            try:
                return await ask(c), ceiling
            finally:
                await c.post("/admin/guard", json={"tier": "balanced", "custom_ceiling": 0})

    refused, ceiling = live.run(main(), timeout=300)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "prefill_memory_exceeded" and "needs about" in error["message"]
    assert error["estimated_bytes"] > error["limit_bytes"] > 0
    assert error["estimated_bytes"] - error["limit_bytes"] > 0.5 * peak  # the tower's bytes, counted
    assert live.arbiter.pool.worker_for("eyes") is not None  # the worker lives on
