"""What crosses the supervisor's sockets, with real worker processes, real ZeroMQ and real MLX on
the CPU: what subscribers receive (over ipc, and over TCP plain or with CURVE), malformed,
oversized, wrong-version and forged frames counted and ignored, a Generate too large for the
worker refused. Each test runs an `Arbiter` inside the test's own event loop.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from shared import protocol as p
from supervisor.config import ModelConfig
from supervisor.doors.refusals import LoadError
from supervisor.policy.status import ServerStatus
from supervisor.wiring.bus import Endpoints
from tests.arbiter_harness import Running, collect, make_config
from tests.http_harness import until

pytestmark = pytest.mark.slow


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
