"""The bus under garbage: real ZeroMQ sockets, no worker process.

Garbage frames were counted and "logged once" under keys built from text the
sender controls (the message type a frame claims, the protocol version it
claims): 100k distinct frames grew memory by 17-25 MiB and wrote ~78k WARNING
lines. The counters and the log are now keyed by a fixed set of causes, which the
decoder names (`Malformed.cause`) rather than the bus working them out from its words.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq

from supervisor.wiring.bus import Bus, Endpoints


def _flood(tmp_path, frames: list[bytes | list[bytes]]) -> Bus:
    async def main() -> Bus:
        ctx = zmq.Context()  # its own: the ZAP endpoint is one per context, freed only when it ends
        bus = Bus(ctx, Endpoints.in_dir(tmp_path))
        bus.attach(asyncio.get_running_loop(), lambda *_: None, lambda *_: None, lambda *_: None)
        push = ctx.socket(zmq.PUSH)
        push.connect(bus.endpoints.reports)
        for frame in frames:
            while True:
                try:
                    push.send_multipart(frame if isinstance(frame, list) else [frame], zmq.NOBLOCK)
                    break
                except zmq.Again:  # the bus reads in this same loop
                    await asyncio.sleep(0.005)
        for _ in range(500):
            if bus.malformed_total >= len(frames):
                break
            await asyncio.sleep(0.01)
        push.close(0)
        bus.close()
        ctx.term()
        return bus

    return asyncio.run(main())


def test_distinct_garbage_frames_keep_a_fixed_number_of_counters_and_log_lines(tmp_path, caplog):
    claims = [msgspec.msgpack.encode({"type": f"Evil{i}", "v": 1}) for i in range(2000)]
    versions = [msgspec.msgpack.encode({"type": "Sample", "v": 1000 + i}) for i in range(2000)]
    junk = [bytes([0xC1]) + i.to_bytes(4, "little") for i in range(2000)]
    with caplog.at_level(logging.WARNING, logger="memvisor.bus"):
        bus = _flood(tmp_path, claims + versions + junk)
    assert bus.malformed_total == 6000
    causes = {cause for _socket, cause in bus.malformed}
    assert causes <= {"invalid_message", "wrong_version", "undecodable"}
    assert len(bus.malformed) == len(causes) <= 3
    refused = [r for r in caplog.records if r.name == "memvisor.bus"]
    assert len(refused) == len(causes)  # one line per cause a minute, not one per distinct text


def test_each_refused_frame_is_counted_under_the_cause_the_decoder_gives(tmp_path):
    frames: list[bytes | list[bytes]] = [
        b"\xc1",                                                        # not msgpack
        msgspec.msgpack.encode({"type": "sample", "v": 7}),              # another protocol version
        msgspec.msgpack.encode({"type": "worker_event", "v": 1, "worker_id": "w", "kind": "crash",
                                "message": "a worker posing as the supervisor's lifecycle"}),
        [b"two", b"frames"],                                             # one frame expected on PULL
    ]
    bus = _flood(tmp_path, frames)
    assert dict(bus.malformed) == {("reports", "undecodable"): 1, ("reports", "wrong_version"): 1,
                                   ("reports", "invalid_message"): 1, ("reports", "frame_count"): 1}


def test_subscribers_past_the_cap_are_refused_and_one_gets_in_when_a_place_frees(tmp_path):
    """Any number could connect, each queueing up to the high-water mark."""

    async def main():
        ctx = zmq.Context()
        bus = Bus(ctx, Endpoints.in_dir(tmp_path), max_subscribers=3)
        bus.attach(asyncio.get_running_loop(), lambda *_: None, lambda *_: None, lambda *_: None)
        subs = []
        for _ in range(5):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(bus.endpoints.pub)
            subs.append(sub)
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        bus.pub.send_multipart([b"event", b"x"])
        await asyncio.sleep(0.3)
        got = [bool(sub.poll(0)) for sub in subs]
        refused, connected = bus.subscribers.refused, bus.subscribers.connected
        for sub in subs:
            sub.close(0)
        bus.close()
        ctx.term()
        return got, refused, connected

    got, refused, connected = asyncio.run(main())
    assert got == [True, True, True, False, False]
    assert refused >= 2 and connected <= 3 + 2  # refused peers come and go while they retry


def _state(t: float) -> list:
    from shared import protocol as p

    return [p.CeilingMsg(t=t, enabled=True, tier="balanced", ceiling=1 << 30, static=0, dynamic=0, gpu_cap=0,
                         binding="static", soft_bytes=1 << 29, hard_bytes=3 << 28, reserve=0),
            p.PressureMsg(t=t, level="ok", usage=1 << 20, soft_bytes=1 << 29, hard_bytes=3 << 28, ceiling=1 << 30,
                          utilization=0.001, admission_paused=False, interval=10.0),
            p.StatusMsg(t=t, status=b"{}")]


def test_a_new_subscriber_gets_the_latest_ceiling_pressure_and_status_at_once(tmp_path):
    """`watch --topic ceiling --count 1` waited up to one slow tick (9.7 s measured) for its first
    message: a subscriber that connects between two ticks now gets the latest state topics at once
    (XPUB last-value cache), each subscription for the topics it covers."""
    from shared import protocol as p

    async def main():
        ctx = zmq.Context()
        bus = Bus(ctx, Endpoints.in_dir(tmp_path))
        bus.attach(asyncio.get_running_loop(), lambda *_: None, lambda *_: None, lambda *_: None)
        for msg in _state(1.0) + _state(2.0):  # nobody listens yet; the second round is the latest
            bus.publish(msg)
        codec = p.Codec(p.Published)
        got: dict[str, list] = {}
        for topics in ([b"ceiling"], [b""], [b"pressure", b"status"], [b"sample"]):
            sub = ctx.socket(zmq.SUB)
            for topic in topics:
                sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(bus.endpoints.pub)
            seen = []
            deadline = asyncio.get_running_loop().time() + 1.0  # nothing is published meanwhile
            while asyncio.get_running_loop().time() < deadline:
                while sub.poll(0):
                    name, frame = sub.recv_multipart()
                    seen.append((name.decode(), codec.decode(frame).t))
                await asyncio.sleep(0.01)
            got[b",".join(topics).decode()] = seen
            sub.close(0)
        bus.close()
        ctx.term()
        return got

    got = asyncio.run(main())
    assert got["ceiling"] == [("ceiling", 2.0)]
    assert sorted(got[""]) == [("ceiling", 2.0), ("pressure", 2.0), ("status", 2.0)]
    assert sorted(got["pressure,status"]) == [("pressure", 2.0), ("status", 2.0)]
    assert got["sample"] == []  # samples and events are not state: no replay
