"""The supervisor's one loop never waits on the disk, and a stall of
the loop never kills healthy workers. Real worker processes, real ZeroMQ."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import msgspec
import pytest

from shared import protocol as p
from supervisor.arbiter import Arbiter
from supervisor.config import Config, ModelConfig
from supervisor.config_file import load_config
from supervisor.doors.refusals import LoadError, ServeError
from tests.arbiter_harness import Running, collect, make_config
from tests.http_harness import until

pytestmark = pytest.mark.slow


def test_a_loop_stall_longer_than_the_heartbeat_window_kills_no_worker(tiny_models, runtime_dir):
    """Before: the loop blocked 2.5 s against a 1 s window; at its next beat every
    worker, the pinned one included, was killed as wedged."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True),
                          ModelConfig(id="b", path=str(tiny_models.b))],
                         heartbeat_interval=0.2, heartbeat_timeout=1.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            a = await arb.models.load("a")
            b = await arb.models.load("b")
            await asyncio.sleep(0.5)
            time.sleep(2.5)  # the loop itself is stalled (as a slow rescan on it did)
            await asyncio.sleep(2.0)  # several beats after it
            assert arb.pool.counters.wedged == 0, [e.reason for e in arb.events if e.kind == "wedged"]
            assert a.live and b.live and a.pid and b.pid
            assert any(e.kind == "stall" for e in arb.events)
            stream = await arb.service.generate("a", p.Generate(request_id="after", prompt="hi", max_tokens=2))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished), end

    asyncio.run(main())


def _running(config: Config, runtime_dir, reload_config, config_file=None) -> Arbiter:
    return Arbiter(config, runtime_dir, max_workers=8, http=False, reload_config=reload_config,
                   config_file=config_file)


async def _started(arb: Arbiter) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(arb.run())
    await until(lambda: arb.running, what="start")
    return task


async def _stopped(arb: Arbiter, task: asyncio.Task) -> None:
    arb.stop()
    await asyncio.wait_for(task, 30)


def test_a_slow_reload_scan_runs_off_the_loop_and_is_applied_when_it_completes(tiny_models, runtime_dir):
    """Before: the rescan ran inside the loop; nothing else ran until it returned."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])
    bigger = msgspec.structs.replace(config, models=[*config.models, ModelConfig(id="e", path=str(tiny_models.b))])

    def slow_rescan() -> Config:
        time.sleep(2.0)  # 150,000 folders
        return bigger

    async def main():
        arb = _running(config, runtime_dir, slow_rescan)
        task = await _started(arb)
        try:
            reload = asyncio.get_running_loop().create_task(arb.service.reload("test"))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            await asyncio.sleep(0.2)
            assert time.monotonic() - started < 1.0  # the loop ran while the scan did
            with pytest.raises(ServeError) as busy:
                await arb.service.reload("again")
            assert busy.value.code == "reload_busy"
            assert arb.config.model("e") is None  # not applied before the scan completes
            assert "added e" in await reload
            assert arb.config.model("e") is not None and arb.events[-1].kind == "reload"
        finally:
            await _stopped(arb, task)

    asyncio.run(main())


def test_a_reload_that_raises_is_refused_and_said_never_dropped(tiny_models, runtime_dir):
    """Before: a ValueError out of the rescan (a folder `My Model (4bit)`) left the
    SIGHUP task with an unretrieved exception: no event, no refusal."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    def broken() -> Config:
        raise ValueError("id: 'My Model (4bit)' is not a usable model id")

    async def main():
        arb = _running(config, runtime_dir, broken)
        task = await _started(arb)
        try:
            with pytest.raises(ServeError) as err:
                await arb.service.reload("test")
            assert err.value.code == "invalid_config" and "My Model (4bit)" in str(err.value)
            assert arb.events[-1].kind == "reload_refused"
        finally:
            await _stopped(arb, task)

    asyncio.run(main())


def test_a_named_pipe_as_the_config_file_refuses_the_reload_at_once(tiny_models, runtime_dir, tmp_path):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])
    fifo = tmp_path / "memvisor.toml"
    os.mkfifo(fifo)

    def read_it() -> Config:
        return load_config(fifo)

    async def main():
        arb = _running(config, runtime_dir, read_it, config_file=fifo)
        task = await _started(arb)
        try:
            started = time.monotonic()
            with pytest.raises(ServeError) as err:
                await arb.service.reload("test")
            assert "named pipe" in str(err.value) and time.monotonic() - started < 2.0
            assert arb.config.model("a") is not None
        finally:
            await _stopped(arb, task)

    try:
        asyncio.run(main())
    finally:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # free a regression's stuck reader
        except OSError:
            pass


def test_a_non_pinned_model_whose_reloaded_path_fails_is_not_respawned(tiny_models, runtime_dir, tmp_path):
    """Before: its failed load after the reload was scheduled for respawn like a pinned model's."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no weights: refused before a spawn
    config = make_config([ModelConfig(id="b", path=str(tiny_models.b))])
    moved = msgspec.structs.replace(config, models=[ModelConfig(id="b", path=str(broken))])

    async def main():
        arb = _running(config, runtime_dir, lambda: moved)
        task = await _started(arb)
        try:
            await arb.models.load("b")
            await arb.service.reload("test")
            await asyncio.sleep(2.5)  # a respawn would have come after 0.5 s
            assert arb.models.life("b").state != "respawning"
            assert not any(e.kind == "respawn" for e in arb.events), [e.reason for e in arb.events]
        finally:
            await _stopped(arb, task)

    asyncio.run(main())


def test_a_broken_non_pinned_model_is_marked_failed_not_spawned_per_request(tiny_models, runtime_dir,
                                                                                    tmp_path):
    """Before: each request for it started a worker that failed to load."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models.a, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_architecture"}))
    config = make_config([ModelConfig(id="x", path=str(broken))])

    async def main():
        arb = _running(config, runtime_dir, None)
        task = await _started(arb)
        try:
            with pytest.raises(LoadError):
                await arb.models.load("x")
            for _ in range(3):
                with pytest.raises(LoadError) as again:
                    await arb.models.load("x")
                assert again.value.code == "model_failed" and again.value.retry_after
            assert arb.pool.counters.spawned == 1
            assert any(e.kind == "failed" for e in arb.events)
        finally:
            await _stopped(arb, task)

    asyncio.run(main())


def test_a_request_waiting_for_a_load_is_served_from_the_path_a_reload_moved_it_to(tiny_models,
                                                                                         runtime_dir):
    """Before: the reload stopped the loading worker and the waiting request failed (worker_exited)."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])
    moved = msgspec.structs.replace(config, models=[ModelConfig(id="a", path=str(tiny_models.b))])

    async def main():
        arb = _running(config, runtime_dir, lambda: moved)
        task = await _started(arb)
        try:
            waiting = asyncio.get_running_loop().create_task(arb.models.load("a"))
            await until(lambda: arb.pool.worker_for("a") is not None, what="loading")
            await arb.service.reload("test")
            handle = await asyncio.wait_for(waiting, 120)
            assert handle.model.path == str(tiny_models.b) and handle.serving
        finally:
            await _stopped(arb, task)

    asyncio.run(main())
