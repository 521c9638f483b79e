"""The supervisor with real worker processes, real ZeroMQ and real MLX on the CPU.

Most tests run an `Arbiter` inside the test's own event loop (so they can
reach in and wait for exact states); the orphan test runs `python -m
supervisor serve` as a separate process so it can SIGKILL it.
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
import zmq

from shared import protocol as p
from supervisor.arbiter import Arbiter
from supervisor.config import ModelConfig
from supervisor.doors.refusals import LoadError
from supervisor.policy.decisions import Stop
from supervisor.policy.snapshot import Snapshot
from supervisor.policy.status import ServerStatus
from supervisor.wiring.bus import Endpoints
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


def test_subscriber_receives_ceiling_sample_and_status_messages(tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)])

    async def main():
        async with Running(config, runtime_dir) as arb:
            ctx = zmq.Context.instance()
            sub = ctx.socket(zmq.SUB)
            for topic in (b"ceiling", b"sample", b"status"):
                sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(arb.endpoints.pub)
            await arb.models.load("a")
            codec = p.Codec(p.Published)
            seen: dict[str, object] = {}
            deadline = time.monotonic() + 30
            while len(seen) < 3 and time.monotonic() < deadline:
                arb.wake()
                await asyncio.sleep(0.05)
                while sub.poll(0):
                    topic, frame = sub.recv_multipart()
                    seen[topic.decode()] = codec.decode(frame)
            sub.close(0)
            assert isinstance(seen.get("ceiling"), p.CeilingMsg), seen
            assert seen["ceiling"].ceiling > 0
            sample = seen.get("sample")
            assert isinstance(sample, p.Sample) and sample.model_id == "a" and sample.memory.footprint > 0
            status = seen.get("status")
            assert isinstance(status, p.StatusMsg)
            decoded = msgspec.json.decode(status.status, type=ServerStatus)
            assert [m.id for m in decoded.models] == ["a"] and decoded.guard.ceiling > 0

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


def test_custom_ceiling_below_two_models_stops_the_idle_lru_one(tiny_models, runtime_dir):
    """Two idle non-pinned models over soft: the least recently used goes (P6.2), with an event saying why."""
    config = make_config(
        [ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="b", path=str(tiny_models.b))],
    )

    async def main():
        async with Running(config, runtime_dir) as arb:
            a = await arb.models.load("a")
            b = await arb.models.load("b")
            await until(lambda: a.sample is not None and b.sample is not None, what="samples")
            arb.wake()
            await asyncio.sleep(0.3)
            usage = arb.enforcer.last.usage
            # A soft watermark (0.90 of the custom ceiling) half a model below usage:
            # stopping one idle model is enough, whatever the supervisor's own footprint
            # (in a long test session this process holds hundreds of MiB).
            ceiling = int((usage - min(a.sample.memory.usage, b.sample.memory.usage) // 2) / 0.90)
            arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=ceiling))
            await until(lambda: a.state in ("draining", "stopped"), what="LRU model a evicted")
            assert b.state in ("ready", "busy")
            evictions = [e for e in arb.events if e.kind == "evict"]
            assert evictions and evictions[0].model_id == "a" and evictions[0].reason

    asyncio.run(main())


def _send_raw(endpoint: str, kind: int, frames: list[bytes], identity: bytes | None = None) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 500)
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    s.connect(endpoint)
    time.sleep(0.05)
    s.send_multipart(frames)
    time.sleep(0.05)
    s.close()


def test_malformed_oversized_and_wrong_version_frames_are_counted_and_ignored(tiny_models, runtime_dir, caplog):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])
    wrong_version = msgspec.msgpack.encode({"type": "status_request", "v": 99})
    bad_sample = msgspec.msgpack.encode({"type": "sample", "v": 1, "worker_id": 5})

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            ep = arb.endpoints
            loop = asyncio.get_running_loop()
            sends = [
                (ep.control, zmq.DEALER, [b"\xc1garbage"]),
                (ep.control, zmq.DEALER, [wrong_version]),
                (ep.control, zmq.DEALER, [b"x", b"y"]),
                (ep.commands, zmq.DEALER, [b"\x00" * (p.MAX_FRAME_BYTES + 10)]),  # dropped by zmq
                (ep.commands, zmq.DEALER, [msgspec.msgpack.encode({"type": "pong", "v": 7, "seq": 1})]),
                (ep.reports, zmq.PUSH, [bad_sample]),
                (ep.reports, zmq.PUSH, [b"junk"]),
            ]
            for endpoint, kind, frames in sends:
                await loop.run_in_executor(None, _send_raw, endpoint, kind, frames)
            await until(lambda: arb.bus.malformed_total >= 6, what="bad frames counted")
            by_socket = {s for s, _ in arb.bus.malformed}
            assert {"control", "commands", "reports"} <= by_socket
            assert any("v99" in r.getMessage() for r in caplog.records)
            # the same garbage again is counted but not logged again
            logged = len([r for r in caplog.records if "refused a frame" in r.getMessage()])
            await loop.run_in_executor(None, _send_raw, ep.reports, zmq.PUSH, [b"junk"])
            await until(lambda: arb.bus.malformed_total >= 7, what="repeat counted")
            assert len([r for r in caplog.records if "refused a frame" in r.getMessage()]) == logged
            # and everything still works
            stream = await arb.service.generate("a", p.Generate(request_id="still", prompt="ok", max_tokens=2))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished)

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


def test_a_recorded_trace_replays_to_the_same_decisions(tiny_models, runtime_dir, tmp_path):
    """serve --trace records what the guard saw; replaying it gives what it decided."""
    from supervisor.policy.replay import replay_lines

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="b", path=str(tiny_models.b))])
    trace = tmp_path / "trace.jsonl"

    async def main():
        arb = Arbiter(config, runtime_dir, max_workers=8, http=False, trace=trace)
        task = asyncio.get_running_loop().create_task(arb.run())
        await until(lambda: arb.running, what="start")
        await arb.models.load("a")
        await arb.models.load("b")
        await until(lambda: all(h.sample for h in arb.pool.handles.values()), what="samples")
        arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=arb.enforcer.last.usage // 2))
        await until(lambda: len(arb.pool.handles) < 2, what="an eviction")
        arb.stop()
        await task
        return [e.worker_id for e in arb.events if e.kind == "evict"]

    evicted_live = asyncio.run(main())
    assert evicted_live
    lines = trace.read_bytes().splitlines()
    assert len(lines) > 3 and all(msgspec.json.decode(line, type=Snapshot) for line in lines)
    replayed = list(replay_lines(lines, chained=False))
    stopped = [d.worker for r in replayed for d in r.decisions if isinstance(d, Stop)]
    assert stopped[: len(evicted_live)] == evicted_live


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


def test_a_generate_too_large_for_the_worker_is_refused_not_left_hanging(tiny_models, runtime_dir):
    """The worker drops a command frame over MAX_COMMAND_BYTES unread, so a Generate
    sent anyway (a prompt past 4 MiB, allowed by a larger [supervisor] max_body)
    never got a terminal message: its client waited forever."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            big = p.Generate(request_id="big", prompt="x" * (p.MAX_COMMAND_BYTES + 1), max_tokens=2)
            with pytest.raises(LoadError, match="too large") as err:
                await arb.service.generate("a", big)
            assert (err.value.http_status, err.value.code) == (413, "request_too_large")
            assert arb.pool.streams.by_id == {}
            stream = await arb.service.generate("a", p.Generate(request_id="small", prompt="ok", max_tokens=2))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished)

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


def test_a_trace_that_cannot_be_written_stops_tracing_not_the_guard(tiny_models, runtime_dir, caplog):
    """serve --trace on a full disk: the write's OSError escaped the enforcer's tick
    into the arbiter's loop and stopped the supervisor, and its workers with it."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        arb = Arbiter(config, runtime_dir, max_workers=8, http=False, trace=Path("/dev/full"))
        task = asyncio.get_running_loop().create_task(arb.run())
        await until(lambda: arb.running, what="start")
        ticks = arb.enforcer.ticks
        while arb.enforcer.ticks < ticks + 50 and not task.done():  # past the file's write buffer
            arb.wake()
            await asyncio.sleep(0.005)
        assert not task.done() and arb.running
        assert arb.enforcer.trace is None
        assert any("tracing stops" in r.getMessage() for r in caplog.records)
        arb.stop()
        assert await asyncio.wait_for(task, 30) == 0

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


def test_a_worker_event_cannot_pose_as_a_crash_and_mark_a_live_model_failed(tiny_models, runtime_dir):
    """A report's event kind went straight into the arbiter's lifecycle handling:
    kind "crash" scheduled a respawn of a live pinned worker and counted it
    against the restart intensity, so a few such frames marked a healthy model
    failed (and "need_memory" raised KeyError in the handler)."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)], restart_max=1)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            forged = msgspec.msgpack.encode({"type": "worker_event", "v": 1, "worker_id": handle.worker_id,
                                             "kind": "crash", "message": "forged"})
            loop = asyncio.get_running_loop()
            for n in range(1, 4):
                await loop.run_in_executor(None, _send_raw, arb.endpoints.reports, zmq.PUSH, [forged])
                await until(lambda n=n: arb.bus.malformed_total >= n, what="forged event refused")
                await asyncio.sleep(0.6)  # past the first respawn backoff
            assert "a" not in arb.models.failed and arb.pool.worker_for("a") is handle
            assert not any(e.kind in ("crash", "respawn", "failed") for e in arb.events)
            codec = p.Codec(p.WorkerReport)  # what a real worker reports still goes through
            drill = p.WorkerEvent(worker_id=handle.worker_id, kind="drill", message="drill started")
            assert codec.decode(codec.encode(drill)) == drill

    asyncio.run(main())


def test_t6_a_custom_ceiling_past_64_bits_is_refused_and_the_guard_keeps_ticking(tiny_models, runtime_dir):
    """A GuardUpdate carries up to 2**64-1. Past int64 the ceiling cannot go into the
    ledger's limits, so no worker got new limits again (one logged exception per
    tick); past 2**64 (an HTTP or config size) it could not even be published and
    the tick raised inside the arbiter's loop, stopping the supervisor."""
    from supervisor.wiring.control_answers import handle_control

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            reply = await handle_control(arb.service, p.GuardUpdate(tier="custom", custom_ceiling=2**64 - 1))
            assert isinstance(reply, p.ControlError) and reply.code == "invalid_request"
            assert "custom ceiling" in reply.message and arb.enforcer.settings.custom_ceiling == 0
            ticks = arb.enforcer.ticks
            arb.wake()
            await until(lambda: arb.enforcer.ticks > ticks, what="another tick")
            assert arb.running

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


def test_opt_in_tcp_pub_plain_on_loopback_and_curve_beyond_it(tiny_models, runtime_dir, tmp_path):
    """Dashboards elsewhere subscribe over TCP; off loopback only with the server's CURVE key."""
    import zmq.auth

    from supervisor.wiring.client import subscribe

    _public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "memvisor")
    models = [ModelConfig(id="a", path=str(tiny_models.a))]

    def first_ceiling(endpoint: str, key: str = "", timeout: float = 10.0):
        for topic, msg in subscribe(runtime_dir, ["ceiling"], timeout=timeout, endpoint=endpoint, server_key=key):
            return topic, msg

    async def check(config, *, curve: bool):
        async with Running(config, runtime_dir) as arb:
            ep = arb.endpoints
            assert ep.pub_tcp.startswith("tcp://") and bool(ep.pub_tcp_key) == curve
            assert msgspec.json.decode((runtime_dir / "endpoints.json").read_bytes(), type=Endpoints) == ep
            port = ep.pub_tcp.rsplit(":", 1)[1]
            loop = asyncio.get_running_loop()
            got = loop.run_in_executor(None, first_ceiling, f"tcp://127.0.0.1:{port}", ep.pub_tcp_key)
            while not got.done():
                arb.enforcer._last_ceiling = None  # publish the ceiling again on the next tick
                arb.wake()
                await asyncio.sleep(0.1)
            topic, msg = await got
            assert topic == "ceiling" and isinstance(msg, p.CeilingMsg) and msg.ceiling > 0
            if curve:  # without the server's key the handshake never completes: nothing arrives
                plain = loop.run_in_executor(None, first_ceiling, f"tcp://127.0.0.1:{port}", "", 2.0)
                while not plain.done():
                    arb.enforcer._last_ceiling = None
                    arb.wake()
                    await asyncio.sleep(0.1)
                with pytest.raises(TimeoutError):
                    await plain

    asyncio.run(check(make_config(models, pub_tcp="127.0.0.1:0"), curve=False))
    asyncio.run(check(make_config(models, pub_tcp="0.0.0.0:0", curve_key_file=secret_file), curve=True))
