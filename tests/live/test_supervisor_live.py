"""The supervisor's life with real worker processes, real ZeroMQ and real MLX on the CPU: spawn,
load and unload, a worker SIGKILLed, SIGSTOPped or stuck loading, restart intensity, a worker the
OS cannot start, a second supervisor on the same runtime dir, orphans, ^C twice.

Most tests run an `Arbiter` inside the test's own event loop (so they can
reach in and wait for exact states); the orphan test runs `python -m
supervisor serve` as a separate process so it can SIGKILL it. What crosses the
sockets is tests/live/test_supervisor_wire_live.py; the guard in the running
supervisor, tests/live/test_supervisor_guard_live.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from shared import protocol as p
from supervisor.arbiter import Arbiter
from supervisor.config import ModelConfig
from supervisor.doors.refusals import LoadError
from tests.arbiter_harness import Running, collect, make_config
from tests.http_harness import until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_spawn_load_generate_and_unload(tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            assert handle.state in ("ready", "busy") and handle.pid > 0
            stream = await arb.service.generate("a", p.Generate(request_id="r1", prompt="hello", max_tokens=8))
            text, end = await collect(stream)
            assert isinstance(end, p.Finished), end
            assert end.completion_tokens == 8 and end.finish_reason == "length"
            pid = handle.pid
            assert await arb.service.unload("a", admin=True)
            assert handle.state == "stopped" and "cleanly" in handle.exit_cause
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    asyncio.run(main())


def test_sigkill_of_pinned_worker_is_logged_and_respawned(tiny_models, runtime_dir, caplog):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)])

    async def main():
        async with Running(config, runtime_dir) as arb:
            first = await arb.models.load("a")
            os.kill(first.pid, signal.SIGKILL)
            await until(lambda: first.state == "dead", what="crash noticed")
            assert "Perhaps out of memory?" in first.exit_cause
            await until(lambda: (w := arb.pool.worker_for("a")) is not None and w is not first
                        and w.state in ("ready", "busy"), what="respawn")
            stream = await arb.service.generate("a", p.Generate(request_id="after", prompt="hi", max_tokens=3))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished)
            kinds = [e.kind for e in arb.events]
            assert "crash" in kinds and "respawn" in kinds

    asyncio.run(main())


def test_sigstopped_worker_is_detected_as_wedged_killed_and_respawned(tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)],
                         heartbeat_interval=0.2, heartbeat_timeout=1.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            first = await arb.models.load("a")
            os.kill(first.pid, signal.SIGSTOP)
            await until(lambda: first.state in ("wedged", "dead", "stopped") and first.exited.done(), timeout=20,
                        what="wedge detected and killed")
            assert any(e.kind == "wedged" for e in arb.events)
            await until(lambda: (w := arb.pool.worker_for("a")) is not None and w is not first
                        and w.state in ("ready", "busy"), what="respawn after wedge")

    asyncio.run(main())


def test_restart_intensity_exhausted_marks_model_failed(tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)],
                         restart_max=2, restart_period=60.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            for _ in range(3):
                w = await arb.models.load("a")
                os.kill(w.pid, signal.SIGKILL)
                await until(lambda w=w: w.state in ("dead", "failed"), what="crash noticed")  # failed: gave up
                await until(lambda: "a" in arb.models.failed or arb.pool.worker_for("a") is not None,
                            what="respawn or failure")
            await until(lambda: "a" in arb.models.failed, what="model marked failed")
            assert "2 restarts" in arb.models.failed["a"]
            with pytest.raises(LoadError, match="marked failed") as err:
                await arb.models.load("a")
            assert err.value.http_status == 503
            await asyncio.sleep(1.0)
            assert arb.pool.worker_for("a") is None  # not respawned forever

    asyncio.run(main())


def test_workers_die_with_a_sigkilled_supervisor(tiny_models, tmp_path_factory):
    runtime_dir = Path(tmp_path_factory.mktemp("orphan"))
    cfg = runtime_dir / "c.toml"
    cfg.write_text(
        "[supervisor]\nheartbeat_interval = 0.2\nheartbeat_timeout = 2.0\n"
        f'[[models]]\nid = "a"\npath = "{tiny_models.a}"\npinned = true\n'
        f'[[models]]\nid = "b"\npath = "{tiny_models.b}"\npinned = true\n'
    )
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config", str(cfg),
                             "--runtime-dir", str(runtime_dir), "--http", "off"], cwd=ROOT)
    try:
        from supervisor.wiring.client import ControlClient

        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            try:
                with ControlClient(runtime_dir, timeout=2) as c:
                    reply = c.call(p.StatusRequest())
                    if isinstance(reply, p.ControlOk):
                        status = msgspec.json.decode(reply.data)
                        if len([w for w in status["guard"]["workers"] if w["state"] in ("ready", "busy")]) == 2:
                            break
            except Exception:
                pass
            time.sleep(0.2)
        pids = [w["pid"] for w in status["guard"]["workers"]]
        assert len(pids) == 2
        proc.kill()
        proc.wait(10)
        gone_by = time.monotonic() + 5
        while time.monotonic() < gone_by and any(_alive(pid) for pid in pids):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "orphaned workers outlived the supervisor"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (its memory is back)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_worker_stuck_before_it_has_loaded_is_wedged_after_the_load_timeout(tiny_models, runtime_dir):
    """A load blocks the worker's loop, so heartbeats cannot judge it; the load
    timeout does. Without it a hung load would hold every waiter forever."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], load_timeout=2.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            loading = asyncio.get_running_loop().create_task(arb.models.load("a"))
            await until(lambda: arb.pool.worker_for("a") is not None, what="spawn")
            stuck = arb.pool.worker_for("a")
            os.kill(stuck.pid, signal.SIGSTOP)
            with pytest.raises(LoadError, match="before the model was loaded"):
                await asyncio.wait_for(loading, 30)
            assert any(e.kind == "wedged" and "still loading" in e.reason for e in arb.events)
            assert stuck.exited.done()

    asyncio.run(main())


def test_a_second_supervisor_refuses_a_runtime_dir_in_use_and_clients_see_a_dead_one(tiny_models, runtime_dir):
    from supervisor.wiring.bus import RuntimeDirBusy, claim_runtime_dir
    from supervisor.wiring.client import ControlClient, NotRunning

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])
    cfg = runtime_dir.parent / f"{runtime_dir.name}.toml"
    cfg.write_text(f'[[models]]\nid = "a"\npath = "{tiny_models.a}"\n')

    async def arb_roundtrip(arb):
        return await arb.pool.watchdog.ping(await arb.models.load("a"))

    async def main():
        async with Running(config, runtime_dir) as first:
            second = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "supervisor", "serve", "--runtime-dir", str(runtime_dir), "--http", "off",
                "--config", str(cfg), cwd=ROOT, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(second.communicate(), 60)
            assert second.returncode == 2
            assert f"another supervisor (pid {os.getpid()}) runs with runtime dir" in err.decode()
            # its sockets were left alone: the first one still answers
            assert (await arb_roundtrip(first)) > 0
            with pytest.raises(RuntimeDirBusy):
                claim_runtime_dir(runtime_dir)
            endpoints = (runtime_dir / "endpoints.json").read_bytes()
        # a supervisor that died without cleaning up: its endpoints.json lingers
        (runtime_dir / "endpoints.json").write_bytes(endpoints.replace(str(os.getpid()).encode(), b"999999"))
        with pytest.raises(NotRunning, match="is gone"):
            ControlClient(runtime_dir)

    asyncio.run(main())


def test_a_worker_stopped_while_loading_stays_draining_when_its_load_completes(tiny_models, runtime_dir):
    """A stop is final. The worker's Hello and Loaded that arrive after it used to set
    the state back to loading and ready, so a worker on its way out showed as ready
    and `load` could hand it out to requests that then failed with model_unloading."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            loading = asyncio.get_running_loop().create_task(arb.models.load("a"))
            await until(lambda: arb.pool.worker_for("a") is not None, what="spawn")
            handle = arb.pool.worker_for("a")
            assert handle.state == "starting"
            states, wake = [], arb.pool.on_change

            def on_change():  # called as each of the worker's messages is taken
                if handle.state == "loading" and handle.stopping is None:
                    arb.pool.stop(handle, "unloaded while loading")  # its Drain is delivered: Hello came
                states.append(handle.state)
                wake()

            arb.pool.on_change = on_change
            await until(lambda: handle.exited.done(), what="drained worker exited")
            await asyncio.gather(loading, return_exceptions=True)
            assert "draining" in states and "ready" not in states, states
            assert handle.state == "stopped" and "cleanly" in handle.exit_cause

    asyncio.run(main())


def test_a_worker_the_os_cannot_start_is_a_503_and_gives_its_ledger_slot_back(tiny_models, runtime_dir):
    """Process creation fails when descriptors (or memory) run out. The OSError used
    to escape as a 500 (and left a CLI `load` waiting for a reply that never came),
    and each failure kept its ledger slot: after max_workers of them no model could
    ever be loaded again."""
    import resource

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            model = config.model("a")
            limits = resource.getrlimit(resource.RLIMIT_NOFILE)
            for _ in range(arb.max_workers + 1):
                # the lowest free descriptor number: with the limit there, no new one can be
                # opened at all (counting open ones left holes below the limit in a long session)
                lowest_free = os.open(os.devnull, os.O_RDONLY)
                os.close(lowest_free)
                resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, limits[1]))
                try:
                    with pytest.raises(LoadError, match="could not start a worker") as err:
                        arb.pool.spawn(model)
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, limits)
                assert (err.value.http_status, err.value.code) == (503, "spawn_failed")
            assert arb.pool.handles == {}
            assert (await arb.models.load("a")).state in ("ready", "busy")

    asyncio.run(main())


def test_a_request_whose_worker_exits_before_it_is_sent_is_refused_not_left_hanging(tiny_models, runtime_dir):
    """The worker dies right after its Loaded, before the request that waited for
    the load resumes. Its exit had already failed the worker's requests, so a
    stream opened now would never get a terminal message; and the Generate could
    still be 'delivered' while ZeroMQ had not yet noticed the peer was gone."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            request = asyncio.get_running_loop().create_task(
                arb.service.generate("a", p.Generate(request_id="r", prompt="hi", max_tokens=3)))
            await until(lambda: arb.pool.worker_for("a") is not None, what="spawn")
            handle, wake = arb.pool.worker_for("a"), arb.pool.on_change

            def on_change():  # as the Loaded is taken: the worker dies, and is reaped at once
                if handle.loaded.done() and handle.proc.exitcode is None:
                    os.kill(handle.pid, signal.SIGKILL)
                    handle.proc.join(10)
                wake()

            arb.pool.on_change = on_change
            with pytest.raises(LoadError, match="stopped before the request reached it") as err:
                await asyncio.wait_for(request, 30)
            assert (err.value.http_status, err.value.code) == (503, "worker_exited")
            assert arb.pool.streams.by_id == {} and arb.pool.running(handle) == 0

    asyncio.run(main())


def test_a_second_sigint_stops_draining_workers_without_waiting_out_the_drain(tiny_models, runtime_dir):
    """'press ^C again to stop without draining': the first ^C had already started
    every worker's drain, and kill() on a stop under way returned that stop as it
    was, so the second ^C changed nothing and shutdown still waited stop_grace
    for a long generation before sending SIGTERM."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], stop_grace=120.0)

    async def main():
        arb = Arbiter(config, runtime_dir, max_workers=8, http=False)
        task = asyncio.get_running_loop().create_task(arb.run())
        await until(lambda: arb.running, what="start")
        handle = await arb.models.load("a")
        stream = await arb.service.generate("a", p.Generate(request_id="long", prompt="hi", max_tokens=4000))  # within the context
        assert isinstance(await asyncio.wait_for(stream.queue.get(), 30), p.TokenOut)
        arb.on_signal(signal.SIGINT)
        await until(lambda: handle.stopping is not None, what="drain started")
        arb.on_signal(signal.SIGINT)
        await asyncio.wait_for(task, 30)  # well before stop_grace
        assert handle.state == "stopped" and signal.SIGTERM in handle.signals_sent
        _, end = await collect(stream)
        assert isinstance(end, p.Failed) and end.code == "worker_exited"

    asyncio.run(main())


def test_a_pinned_model_that_cannot_load_is_retried_then_marked_failed(tmp_path, runtime_dir):
    """It must neither vanish after one logged error nor be retried forever."""
    config = make_config([ModelConfig(id="gone", path=str(tmp_path / "no-such-model"), pinned=True)],
                         restart_max=2, restart_period=60.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            await until(lambda: "gone" in arb.models.failed, timeout=30, what="marked failed")
            assert "load failed" in arb.models.failed["gone"]
            assert arb.models.restarts("gone") == 2
            assert [e.kind for e in arb.events].count("respawn") == 2

    asyncio.run(main())
