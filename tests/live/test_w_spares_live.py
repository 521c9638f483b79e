"""SPEC W1, W2 (spare workers), W3 (a load's phases) and W6 (its progress), with real processes.

Real spare processes with MLX imported, real ZeroMQ, real MLX loads on the CPU:
a load takes the waiting spare (its pid becomes the model's) and a new spare
follows; a spare is stopped first under pressure and is the first room a load
takes; a SIGKILLed or SIGSTOPped spare costs no request; a client sees a load's
phase and bytes read while it runs, and its phases after (event, /metrics, ps).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from shared import protocol as p
from shared.sizes import MiB
from supervisor.arbiter import Arbiter
from supervisor.config import GuardConfig, ModelConfig
from supervisor.workers.process import WorkerHandle
from tests.arbiter_harness import Running, collect, make_config
from tests.http_harness import LiveServer, metric, until
from tests.http_harness import make_config as http_config
from worker.loader import READ_DELAY_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_48(tmp_path_factory) -> Path:
    """48 MiB of float32 weights: a load that needs room a spare (~60 MiB) can give."""
    from modelfiles.modelgen import make_model

    path = tmp_path_factory.mktemp("w48") / "m48"
    make_model(path, 48 * MiB, 4, dtype="float32")
    return path


def spares(arb: Arbiter) -> list[WorkerHandle]:
    return [h for h in arb.pool.handles.values() if h.spare and h.stopping is None]


async def ready_spare(arb: Arbiter, not_pid: int = 0, timeout: float = 60.0) -> WorkerHandle:
    """The spare waiting for a model (with its first memory reading read by a tick)."""
    def found() -> bool:
        arb.wake()
        return any(h.state == "spare" and h.pid != not_pid and h.sample is not None for h in spares(arb))
    await until(found, timeout, "a ready spare")
    return next(h for h in spares(arb) if h.state == "spare" and h.pid != not_pid)


async def generate(arb: Arbiter, model: str = "a") -> p.Msg:
    stream = await arb.service.generate(model, p.Generate(request_id="", prompt="hello", max_tokens=4))
    _, end = await collect(stream)
    return end


def kinds(arb: Arbiter, kind: str) -> list[p.GuardEvent]:
    return [e for e in arb.events if e.kind == kind]


def test_w1_a_load_takes_the_waiting_spare_and_a_new_spare_follows(tiny_models, runtime_dir):
    """The model's worker is the spare's process (its pid, its worker id), and once the
    load and its request are over a new spare starts in the background."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], spare_workers=1)

    async def main():
        async with Running(config, runtime_dir) as arb:
            spare = await ready_spare(arb)
            pid, worker_id = spare.pid, spare.worker_id
            handle = await arb.models.load("a")
            assert (handle.pid, handle.worker_id, handle.model_id) == (pid, worker_id, "a")
            assert isinstance(await generate(arb), p.Finished)
            assert any("takes model a" in e.reason for e in kinds(arb, "spare"))
            fresh = await ready_spare(arb, not_pid=pid)
            assert fresh.pid != pid and arb.pool.worker_for("a") is handle

    asyncio.run(main())


def test_w1_the_model_a_spare_takes_runs_with_the_model_s_request_slots(tiny_models, runtime_dir):
    """A spare's limits carry one request slot (it has no model); the worker that took model a
    is handed a's max_concurrency in the limits its scheduler reads (its ledger slot). The
    custom ceiling holds every other limit still, so only the policy's record of the cap each
    worker's limits carry can send them (before, the enforcer merged the cap into limits sent
    for other reasons, and none came)."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), max_concurrency=3)], spare_workers=1,
                         guard=GuardConfig(hot_cache_max=0, tier="custom", custom_ceiling="64GiB"))

    def slots(arb: Arbiter, handle: WorkerHandle) -> int:
        arb.wake()
        limits = arb.pool.ledger.read_limits(handle.slot)
        return limits.max_concurrency if limits is not None else 0

    async def main():
        async with Running(config, runtime_dir) as arb:
            spare = await ready_spare(arb)
            await until(lambda: slots(arb, spare) == 1, 10, "the spare's limits")
            handle = await arb.models.load("a")
            assert handle is spare and handle.concurrency == 3
            await until(lambda: slots(arb, handle) == 3, 10, "a's request slots in the worker's limits")

    asyncio.run(main())


def test_w2_a_load_that_needs_room_stops_the_spare_and_not_the_idle_model(tiny_models, model_48, runtime_dir):
    """Under a ceiling whose soft target leaves room for the 48 MiB model only without the
    spare (~60 MiB), admission stops the spare (A2 counts it as room) and evicts no model.
    Without spares the same load would have stopped the idle model "a"."""
    models = [ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="big", path=str(model_48))]
    config = make_config(models, spare_workers=1, guard=GuardConfig(hot_cache_max=0, tier="custom",
                                                                     custom_ceiling="64GiB", soft_threshold=0.5,
                                                                     hard_threshold=0.95))

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            spare = await ready_spare(arb)
            st = arb.enforcer.status()
            usage, held = st.usage, spare.sample.memory.usage
            assert held > 24 * MiB, held  # the margins below assume a spare this large
            # soft target = usage + 24 MiB: ok now; usage + 48 MiB passes it, usage - spare + 48 MiB does not
            arb.service.update_guard(p.GuardUpdate(custom_ceiling=int((usage + 24 * MiB) / 0.5)))
            assert arb.enforcer.last.level == "ok"
            await arb.models.load("big")
            room = [e for e in kinds(arb, "spare") if "to make room for big" in e.reason]
            assert room and room[0].worker_id == spare.worker_id
            assert not [e for e in kinds(arb, "evict") if "to make room for big" in e.reason]
            assert arb.pool.worker_for("big").pid != spare.pid  # the stopped spare was not handed it

    asyncio.run(main())


def test_w2_under_pressure_the_spare_goes_first_and_no_spare_starts(tiny_models, runtime_dir):
    """Soft pressure: the spare is stopped before anything else, and no new one starts while
    the pressure lasts; once there is room again, one does."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], spare_workers=1,
                         guard=GuardConfig(hot_cache_max=0, tier="custom", custom_ceiling="64GiB",
                                           soft_threshold=0.5, hard_threshold=0.95))

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            spare = await ready_spare(arb)
            without = arb.enforcer.status().usage - spare.sample.memory.usage
            arb.service.update_guard(p.GuardUpdate(custom_ceiling=int((without - 16 * MiB) / 0.5)))
            await until(lambda: spare.state in ("stopped", "dead"), 30, "the spare's stop")
            first = next(e for e in arb.events if e.kind in ("spare", "evict", "abort", "reclaim", "shrink_cache")
                         and e.t >= kinds(arb, "level")[-1].t)
            assert first.kind == "spare" and "first thing stopped" in first.reason, first
            for _ in range(30):  # 3 s of soft pressure with ticks: no spare
                arb.wake()
                await asyncio.sleep(0.1)
                assert arb.enforcer.last.level != "ok" and not spares(arb)
            arb.service.update_guard(p.GuardUpdate(custom_ceiling=64 * 1024 * MiB))
            await ready_spare(arb)

    asyncio.run(main())


def test_w1_a_killed_spare_is_replaced_and_the_next_load_takes_the_new_one(tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], spare_workers=1)

    async def main():
        async with Running(config, runtime_dir) as arb:
            spare = await ready_spare(arb)
            os.kill(spare.pid, signal.SIGKILL)
            await until(lambda: spare.state == "dead", 30, "the spare's death")
            assert any(e.worker_id == spare.worker_id for e in kinds(arb, "crash"))
            fresh = await ready_spare(arb, not_pid=spare.pid)
            assert isinstance(await generate(arb), p.Finished)
            assert arb.pool.worker_for("a").pid == fresh.pid

    asyncio.run(main())


def test_w1_a_stopped_spare_is_found_wedged_and_the_request_that_came_is_served(tiny_models, runtime_dir):
    """SIGSTOP the spare and ask for the model at once: whether the load took the stopped
    spare (then found wedged, its load goes on in a fresh worker) or not, the request is served."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], spare_workers=1)

    async def main():
        async with Running(config, runtime_dir) as arb:
            spare = await ready_spare(arb)
            os.kill(spare.pid, signal.SIGSTOP)
            try:
                assert isinstance(await asyncio.wait_for(generate(arb), 90), p.Finished)
                await until(lambda: spare.state == "dead", 30, "the stopped spare killed as wedged")
                assert any(e.worker_id == spare.worker_id for e in kinds(arb, "wedged"))
                assert arb.pool.worker_for("a").pid != spare.pid
            finally:
                if spare.state != "dead":
                    os.kill(spare.pid, signal.SIGKILL)

    asyncio.run(main())


def test_g1_w2_a_spare_already_stopping_is_room_a_prefill_waits_for(tiny_models, runtime_dir):
    """G1 through real workers: the ceiling drops under a spare (SIGSTOPped, so its stop lasts
    the whole drain grace) and the guard stops it first (W2). A prompt sent to the pinned model
    meanwhile is short while the spare's memory is still counted; no idle model is left to stop.
    Before, the supervisor answered "nothing to evict" and the request was refused with
    prefill_memory_exceeded; the spare's stop is room on its way: the answer waits for its exit,
    and the request is served after it."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)], spare_workers=1,
                         stop_grace=4.0, guard=GuardConfig(tier="custom", soft_threshold=0.97, hard_threshold=0.99,
                                                           hot_cache_max=0, disk_cache_max=0))

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            spare = await ready_spare(arb)
            await asyncio.sleep(0.5)
            arb.enforcer.tick(time.monotonic())
            usage, held = arb.enforcer.last.usage, spare.sample.memory.usage
            os.kill(spare.pid, signal.SIGSTOP)
            try:
                # the worker's hard limit half a spare below the group's usage: over it with the
                # spare, well under it (with a short prompt's peak) without
                arb.service.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=int((usage - held // 2) / 0.99)))
                await until(lambda: spare.state == "draining", 10, "the guard stopping the spare first (W2)")
                end = await generate(arb)
                assert isinstance(end, p.Finished), end
                assert spare.state in ("stopped", "dead"), "the request was served before the spare's memory came back"
            finally:
                if spare.state not in ("stopped", "dead"):
                    os.kill(spare.pid, signal.SIGKILL)

    asyncio.run(main())


def test_w6_a_client_sees_the_loads_phase_and_bytes_read(model_48, runtime_dir, monkeypatch):
    """While the weights are read (held there 3 s by the test hook), /health?model= and the
    load_progress events on /v1/events say `read` and how many bytes are in."""
    monkeypatch.setenv(READ_DELAY_ENV, "3")
    config = http_config([ModelConfig(id="big", path=str(model_48))], spare_workers=1)
    with LiveServer(config, runtime_dir) as live:
        async def main():
            await ready_spare(live.arbiter)
            async with live.client() as client:
                load = asyncio.get_running_loop().create_task(client.post("/v1/models/big/load"))
                seen = None
                for _ in range(200):
                    body = (await client.get("/health", params={"model": "big"})).json()
                    progress = body.get("progress") or {}
                    # a beat can come mid-read; the 3 s hold after the weights are in is what is waited for
                    if progress.get("phase") == "read" and progress.get("bytes_read", 0) >= 40 * MiB:
                        seen = progress
                        break
                    await asyncio.sleep(0.05)
                assert seen is not None and seen["bytes_read"] >= 40 * MiB, seen
                assert (await load).status_code == 200
                async with client.stream("GET", "/v1/events", params={"topic": "event"}) as events:
                    lines = [json.loads(line[6:]) async for line in _until_loaded(events)]
            reads = [e["load"] for e in lines if e.get("kind") == "load_progress" and e["load"]["phase"] == "read"]
            assert reads and reads[-1]["bytes_read"] >= 40 * MiB and reads[-1]["spare"]

        live.run(main())


async def _until_loaded(events):
    """The replayed `data:` lines of an event stream up to the `loaded` event."""
    async for line in events.aiter_lines():
        if line.startswith("data: "):
            yield line
            if '"kind":"loaded"' in line:
                return


def test_w3_a_loads_phases_are_an_event_a_metrics_histogram_and_in_ps(tiny_models, runtime_dir):
    """A request for the unloaded model: once its first token is out, a `load_phases` event
    gives every phase (the spare's hand-off among them), /metrics counts each phase once, and
    `ps --json` shows them for the model and the new spare as a row of its own."""
    config = http_config([ModelConfig(id="a", path=str(tiny_models.a))], spare_workers=1)
    with LiveServer(config, runtime_dir) as live:
        async def main():
            spare = await ready_spare(live.arbiter)
            async with live.client() as client:
                reply = await client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
                assert reply.status_code == 200
                await until(lambda: kinds(live.arbiter, "load_phases"), 10, "the load's phases")
                done = kinds(live.arbiter, "load_phases")[-1]
                assert done.load.spare and done.worker_id == spare.worker_id
                assert {"admit", "spare", "build", "read", "tokenizer", "first_token"} <= set(done.load.phases)
                text = (await client.get("/metrics")).text
                for phase in ("spare", "read", "first_token"):
                    assert metric(text, "memvisor_load_phase_seconds_count", phase=phase, worker="spare") == 1
            await ready_spare(live.arbiter, not_pid=spare.pid)
            ps = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "supervisor", "ps", "--json", "--runtime-dir", str(runtime_dir), cwd=ROOT,
                stdout=asyncio.subprocess.PIPE)
            rows = json.loads((await ps.communicate())[0])
            model = next(r for r in rows if r["id"] == "a")
            assert model["load_spare"] and set(model["load_phases"]) >= {"spare", "read", "first_token"}
            assert [r["state"] for r in rows if r["id"] == ""] == ["spare"]

        live.run(main())
