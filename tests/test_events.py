"""The PUB topics over HTTP (GET /v1/events, SSE) and the dashboard's files.

The hub (supervisor.wiring.fanout) is tested alone for what must hold however the
doors use it: JSON made once per message, bounded queues, a lagging client
dropped with a final frame, the replay rules. Then the endpoint against a
real supervisor and a real HTTP server (no model is loaded: fast suite).
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from shared import protocol as p
from shared.memory import MemoryReading
from supervisor.wiring import fanout
from supervisor.wiring.fanout import Hub
from tests.http_harness import ADMIN_TOKEN, LiveServer, make_config, non_loopback_address

pytestmark = pytest.mark.usefixtures("no_front_door_errors")


def sample(seq: int, worker: str = "m#1") -> p.Sample:
    return p.Sample(worker_id=worker, model_id="m", pid=1, seq=seq, t=float(seq), memory=MemoryReading(footprint=10, usage=10 + seq))


def event(kind: str, reason: str = "why") -> p.GuardEvent:
    return p.GuardEvent(t=1.0, kind=kind, reason=reason)


def ceiling(value: int) -> p.CeilingMsg:
    return p.CeilingMsg(t=1.0, enabled=True, tier="custom", ceiling=value, static=value, dynamic=value, gpu_cap=0,
                        binding="dynamic", soft_bytes=value // 2, hard_bytes=value * 3 // 4, reserve=0)


def pressure(usage: int) -> p.PressureMsg:
    return p.PressureMsg(t=1.0, level="ok", usage=usage, soft_bytes=50, hard_bytes=75, ceiling=100,
                         utilization=usage / 100, admission_paused=False, interval=1.0)


def drain(sub) -> list:
    return asyncio.run(sub.get(0.01)) or []


# ---------------------------------------------------------------------------
# the hub


def test_json_is_encoded_once_per_message_not_once_per_client(monkeypatch):
    calls = []
    real = fanout.encode_json
    monkeypatch.setattr(fanout, "encode_json", lambda msg: calls.append(msg) or real(msg))
    hub = Hub()
    subs = [hub.subscribe(p.TOPICS) for _ in range(50)]
    hub.publish(sample(1))
    datas = [frames[0].data for frames in (drain(s) for s in subs)]
    assert len(calls) == 1
    assert all(d is datas[0] for d in datas)
    assert json.loads(datas[0])["type"] == "sample"


def test_nothing_is_encoded_while_nobody_listens(monkeypatch):
    calls = []
    monkeypatch.setattr(fanout, "encode_json", lambda msg: calls.append(msg) or b"{}")
    hub = Hub()
    for seq in range(100):
        hub.publish(sample(seq))
    assert calls == []


def test_a_client_that_falls_behind_is_dropped_with_a_final_message():
    hub = Hub(queue_max=4)
    fast, slow = hub.subscribe(p.TOPICS), hub.subscribe(p.TOPICS)
    got = []
    for seq in range(10):
        hub.publish(sample(seq))
        got += drain(fast)
        assert len(slow.queue) <= 4   # bounded, whatever the client does
    assert [json.loads(f.data)["seq"] for f in got] == list(range(10))
    final = drain(slow)
    assert [f.topic for f in final] == ["dropped"]
    notice = json.loads(final[0].data)
    assert "fell 4 messages behind" in notice["reason"] and notice["last_id"] == 5
    assert asyncio.run(slow.get(0.01)) is None           # the stream is over
    assert hub.dropped == 1 and slow not in hub.subscribers and fast in hub.subscribers


def test_a_long_replay_does_not_count_as_lagging():
    """The bound is on live messages: a dashboard asking for minutes of history
    (more frames than queue_max) gets all of them, in order, then live ones."""
    hub = Hub(queue_max=4)
    for seq in range(20):
        hub.publish(sample(seq))
    sub = hub.subscribe(p.TOPICS, since=0)
    hub.publish(sample(20))
    got = []
    while chunk := drain(sub):
        got += chunk
    assert [json.loads(f.data)["seq"] for f in got] == list(range(21))
    assert hub.dropped == 0 and sub in hub.subscribers


def test_topic_filter_applies_to_live_messages_and_replay():
    hub = Hub()
    hub.publish(event("evict"))
    hub.publish(pressure(10))
    sub = hub.subscribe({"pressure"})
    hub.publish(sample(1))
    hub.publish(pressure(20))
    assert [json.loads(f.data)["usage"] for f in drain(sub)] == [10, 20]


def test_default_replay_is_the_event_history_then_the_latest_state():
    hub = Hub(event_history=3)
    hub.publish(ceiling(100))
    for i in range(5):
        hub.publish(event("level", f"change {i}"))
        hub.publish(pressure(i))
        hub.publish(sample(i))
    frames = drain(hub.subscribe(p.TOPICS))
    assert [f.topic for f in frames] == ["ceiling", "event", "event", "event", "pressure"]
    assert [json.loads(f.data)["reason"] for f in frames if f.topic == "event"] == ["change 2", "change 3",
                                                                                    "change 4"]
    assert [f.id for f in frames] == sorted(f.id for f in frames)


def test_since_and_last_event_id_replay_everything_kept_after_them(monkeypatch):
    clock = iter(range(100, 200))
    monkeypatch.setattr(fanout.time, "time", lambda: float(next(clock)))
    hub = Hub()
    for i in range(6):
        hub.publish(sample(i) if i % 2 else event("reclaim", str(i)))   # stamped 100..105
    since = drain(hub.subscribe(p.TOPICS, since=102.5))
    assert [f.wall for f in since] == [103.0, 104.0, 105.0]
    after = drain(hub.subscribe(p.TOPICS, after_id=4))
    assert [f.id for f in after] == [5, 6]
    stale = drain(hub.subscribe(p.TOPICS, after_id=10_000))  # an id of an earlier supervisor
    assert [f.id for f in stale] == [1, 2, 3, 4, 5, 6]


def test_status_carries_s1_inline_as_json():
    hub = Hub()
    sub = hub.subscribe({"status"})
    hub.publish(p.StatusMsg(t=2.0, status=msgspec.json.encode({"guard": {"ceiling": 7}})))
    body = json.loads(drain(sub)[0].data)
    assert body["type"] == "status" and body["status"] == {"guard": {"ceiling": 7}}


def test_closing_the_hub_ends_every_stream_with_a_reason():
    hub = Hub()
    sub = hub.subscribe(p.TOPICS)
    hub.close("the supervisor is shutting down")
    frames = drain(sub)
    assert [f.topic for f in frames] == ["closed"]
    assert json.loads(frames[0].data)["reason"] == "the supervisor is shutting down"
    assert [f.topic for f in drain(hub.subscribe(p.TOPICS))] == ["closed"]


# ---------------------------------------------------------------------------
# GET /v1/events and the dashboard, on a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(make_config([]), tmp_path_factory.mktemp("rt")) as live:
        yield live


def parse_stream(text: str) -> list[tuple[str, str, dict]]:
    """(id, event, data) of each complete SSE event in `text`."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and line[0] != ":")
        if "event" in fields:
            out.append((fields.get("id", ""), fields["event"], json.loads(fields["data"])))
    return out


class Stream:
    """An SSE response read as far as a test needs, and further on the next call."""

    def __init__(self, response) -> None:
        self.chunks = response.aiter_text()
        self.text = ""

    async def until(self, done, timeout: float = 10.0) -> list[tuple[str, str, dict]]:
        async def more():
            while not done(parse_stream(self.text)):
                self.text += await self.chunks.__anext__()
        await asyncio.wait_for(more(), timeout)
        return parse_stream(self.text)


async def read_events(response, until, timeout: float = 10.0) -> list[tuple[str, str, dict]]:
    return await Stream(response).until(until, timeout)


def test_events_open_with_hello_replay_history_then_stream_live(server):
    arb = server.arbiter

    async def main():
        arb.emit("reclaim", "before the client came")
        async with server.client() as c:
            async with c.stream("GET", "/v1/events?topic=event") as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                stream = Stream(r)
                first = await stream.until(lambda ev: any(e[2].get("reason") == "before the client came"
                                                          for e in ev))
                arb.emit("evict", "while the client listens", model_id="m")
                every = await stream.until(lambda ev: any(e[2].get("reason") == "while the client listens"
                                                          for e in ev))
        return first, every[len(first):]

    first, rest = server.run(main())
    assert first[0][1] == "hello" and first[0][2]["topics"] == ["event"]
    assert {e[1] for e in first[1:] + rest} == {"event"}
    live = [e for e in rest if e[2].get("reason") == "while the client listens"][0]
    assert live[2]["kind"] == "evict" and live[2]["model_id"] == "m" and int(live[0]) > 0


def test_last_event_id_resumes_after_it(server):
    arb = server.arbiter

    async def main():
        arb.emit("reclaim", "resume one")
        arb.emit("reclaim", "resume two")
        async with server.client() as c:
            async with c.stream("GET", "/v1/events?topic=event") as r:
                seen = await read_events(r, lambda ev: any(e[2].get("reason") == "resume two" for e in ev))
            one = [e[0] for e in seen if e[2].get("reason") == "resume one"][0]
            async with c.stream("GET", "/v1/events?topic=event", headers={"Last-Event-ID": one}) as r:
                return await read_events(r, lambda ev: any(e[2].get("reason") == "resume two" for e in ev))

    resumed = server.run(main())
    reasons = [e[2].get("reason") for e in resumed[1:]]
    assert reasons == ["resume two"]


@pytest.mark.parametrize("query, param", [("topic=bogus", "topic"), ("since=yesterday", "since"),
                                          ("since=-5", "since"), ("last_event_id=x", "last_event_id")])
def test_bad_query_is_a_400_that_names_the_parameter(server, query, param):
    async def main():
        async with server.client() as c:
            return await c.get("/v1/events?" + query)

    r = server.run(main())
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_a_client_that_reads_nothing_is_dropped_and_then_told_why(server):
    """The guard keeps publishing while a client takes no bytes; its queue stays
    bounded, it is dropped, and the final frame says why once it reads again."""
    arb = server.arbiter
    reason = "x" * 4000

    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v1/events?topic=event HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        before = arb.hub.dropped
        for _batch in range(40):      # ~16 MB: more than the socket buffers hold
            for _ in range(100):
                arb.emit("reclaim", reason)
            await asyncio.sleep(0.005)
            if arb.hub.dropped > before:
                break
        dropped = arb.hub.dropped - before
        queues = [len(s.queue) for s in arb.hub.subscribers]
        tail = b""
        while b"event: dropped" not in tail:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert chunk, "the stream ended without the final message"
            tail = (tail + chunk)[-20000:]
        writer.close()
        return dropped, queues, tail

    dropped, queues, tail = server.run(main())
    assert dropped == 1
    assert all(n <= arb.hub.queue_max for n in queues)
    final = tail[tail.index(b"event: dropped"):].split(b"\n")[1]
    assert b"messages behind and was dropped" in final


def test_dashboard_is_served_from_the_package_with_no_outside_source(server):
    async def main():
        async with server.client() as c:
            return [await c.get(path) for path in ("/", "/ui", "/ui/dashboard.js", "/ui/dashboard.css",
                                                   "/ui/nope.js")]

    root, ui, js, css, missing = server.run(main())
    assert root.status_code == ui.status_code == 200 and root.text == ui.text
    assert root.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in root.headers["content-security-policy"]
    assert '/ui/dashboard.js' in root.text and "http" not in root.text.split("<body>")[0].replace('"/ui', "")
    assert js.headers["content-type"].startswith("text/javascript") and "EventSource" in js.text
    assert css.headers["content-type"].startswith("text/css")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_endpoint"


def test_session_says_admin_for_loopback_only_without_a_token(server):
    address = non_loopback_address()

    async def main():
        async with server.client() as c:
            local = (await c.get("/ui/session")).json()
        remote = None
        if address:
            async with server.client(address) as c:
                remote = (await c.get("/ui/session")).json()
        return local, remote

    local, remote = server.run(main())
    assert local["admin"] is True and local["token_required"] is False
    assert local["tiers"] == ["safe", "balanced", "aggressive", "custom"]
    if remote is not None:
        assert remote["admin"] is False


def test_session_needs_the_admin_token_when_one_is_set(token_server):
    async def main():
        async with token_server.client() as c:
            without = (await c.get("/ui/session")).json()
            wrong = (await c.get("/ui/session", headers={"Authorization": "Bearer nope"})).json()
            right = (await c.get("/ui/session", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).json()
        return without, wrong, right

    without, wrong, right = token_server.run(main())
    assert (without["admin"], without["token_required"]) == (False, True)
    assert (wrong["admin"], wrong["token_required"]) == (False, True)
    assert (right["admin"], right["token_required"]) == (True, False)


# ---------------------------------------------------------------------------
# a ZeroMQ subscriber gets the latest state at once, as /v1/events does: a slow tick must not leave `watch` blank


def test_watch_gets_the_latest_ceiling_at_once_not_at_the_next_slow_tick(server, tmp_path):
    """No model: the supervisor ticks every 30 s (unloaded_idle_interval). Measured before:
    `watch --topic ceiling --count 1` waited up to one slow tick (9.7 s) for its first message."""
    import os
    import sys
    import time

    from supervisor.wiring.client import subscribe

    runtime_dir = server.arbiter.runtime_dir

    def first(topics: list[str]) -> tuple[float, list[str]]:
        started = time.monotonic()
        seen: set[str] = set()
        for topic, _msg in subscribe(runtime_dir, topics, timeout=3.0):  # TimeoutError: the bug
            seen.add(topic)
            if seen == set(topics):
                break
        return time.monotonic() - started, sorted(seen)

    async def main():
        await asyncio.sleep(1.0)  # the first tick is out: the next is ~29 s away
        waited, seen = await asyncio.to_thread(first, ["ceiling", "pressure", "status"])
        watch = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor", "watch", "--runtime-dir", str(runtime_dir), "--topic", "ceiling",
            "--count", "1", "--json", "--timeout", "5", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
        out, err = await asyncio.wait_for(watch.communicate(), 60)
        return waited, seen, watch.returncode, out, err

    waited, seen, rc, out, err = server.run(main())
    assert seen == ["ceiling", "pressure", "status"] and waited < 3.0
    assert rc == 0, err.decode()
    assert json.loads(out)["topic"] == "ceiling"
