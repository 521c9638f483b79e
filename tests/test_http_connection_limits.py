"""Half-sent requests must not exhaust the front door (supervisor/http/connection_limits.py).

Raw sockets against a real supervisor: headers that never end are closed
within `header_timeout`; a connection beyond `max_connections` either closes
the oldest one still sending headers or gets a quick 503, never a hang; a
body that never ends is a 408 on every generation endpoint (it was ignored on
/v1/messages and /v1/responses); keep_alive is parsed strictly before any
generation starts; the open-file limit is raised and a flood of one log line
costs one line a window.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

import pytest

from shared.sizes import GiB
from supervisor.config import ModelConfig
from tests.frontdoor_harness import fake_huge_model
from tests.http_harness import LiveServer, make_config

pytestmark = pytest.mark.usefixtures("no_front_door_errors")

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
CAP = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    models = [ModelConfig(id="huge", path=str(fake_huge_model(root / "huge", 1024 * GiB)))]
    config = make_config(models, http="127.0.0.1:0", header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT,
                         max_connections=CAP)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        yield live


async def open_raw(server):
    return await asyncio.open_connection("127.0.0.1", server.port)


async def read_until_closed(reader, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (raises on `limit`)."""
    start, data = time.monotonic(), b""
    while chunk := await asyncio.wait_for(reader.read(65536), limit):
        data += chunk
    return data, time.monotonic() - start


def test_slow_loris_headers_are_closed_within_the_header_deadline(server):
    """A byte of header every 0.2 s, never the blank line: the connection was held forever."""

    async def main():
        reader, writer = await open_raw(server)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()

        async def drip():
            for _ in range(100):
                await asyncio.sleep(0.2)
                try:
                    writer.write(b"X")
                    await writer.drain()
                except (ConnectionError, RuntimeError):
                    return

        dripping = asyncio.ensure_future(drip())
        data, _ = await read_until_closed(reader, 10)
        closed_after = time.monotonic() - started
        dripping.cancel()
        writer.close()
        return data, closed_after

    data, closed_after = server.run(main())
    assert closed_after < HEADER_TIMEOUT + 1.5, closed_after
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b"header_timeout" in data


def test_a_connection_that_sends_nothing_is_closed_too(server):
    async def main():
        reader, writer = await open_raw(server)
        data, after = await read_until_closed(reader, 10)
        writer.close()
        return data, after

    data, after = server.run(main())
    assert data == b"" and after < HEADER_TIMEOUT + 1.5


def test_beyond_the_cap_the_oldest_idle_connection_makes_room(server):
    """Twice the cap of silent connections: /health still answers at once."""

    async def main():
        idle = [await open_raw(server) for _ in range(2 * CAP)]
        async with server.client() as c:
            health = await c.get("/health")
        for _, w in idle:
            w.close()
        return health

    health = server.run(main())
    assert health.status_code == 200


def test_beyond_the_cap_with_every_connection_busy_is_a_quick_503(server):
    """Every connection inside a request (a body still arriving): the next one gets a 503
    at once, not a hang; once they are gone, new connections are served again."""

    async def main():
        busy = []
        for _ in range(CAP):
            reader, writer = await open_raw(server)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            await writer.drain()
            busy.append((reader, writer))
        await asyncio.sleep(0.2)
        reader, writer = await open_raw(server)
        started = time.monotonic()
        refused, _ = await read_until_closed(reader, 5)
        refused_after = time.monotonic() - started
        writer.close()
        for _, w in busy:
            w.close()
        await asyncio.sleep(0.3)
        async with server.client() as c:
            after = await c.get("/health")
        return refused, refused_after, after

    refused, refused_after, after = server.run(main())
    assert refused.startswith(b"HTTP/1.1 503"), refused
    assert b"too_many_connections" in refused and refused_after < 1.0
    assert after.status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_body_timeout_holds_on_every_generation_endpoint(server, path):
    """A body shorter than its Content-Length: 408 within body_timeout on all three APIs
    (/v1/messages and /v1/responses read with the default 30 s before)."""

    async def main():
        reader, writer = await open_raw(server)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{\"model\"".encode())
        await writer.drain()
        started = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        return head, time.monotonic() - started

    head, after = server.run(main())
    assert head.startswith(b"HTTP/1.1 408"), head
    assert after < BODY_TIMEOUT + 1.0


@pytest.mark.parametrize("keep_alive", ["inf", "nan", "-inf", "1e999", "Infinity", 1e300, "99999999h", "0x10",
                                        True, [1]])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_keep_alive_inf_nan_and_huge_are_400_before_any_generation(server, path, keep_alive):
    """"inf" was a 500 that left a generation running for nobody; "nan" meant "unload now"."""
    body = {"model": "huge", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "keep_alive": keep_alive}

    async def main():
        async with server.client() as c:
            return await c.post(path, json=body)

    r = server.run(main())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "keep_alive" in (error.get("param") or "") and "keep_alive" in error["message"]


@pytest.mark.parametrize("keep_alive,seconds", [
    (-1, 0.0), ("-1", 0.0), ("-1m", 0.0), ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), (2.5, 2.5),
    ("1.5h", 5400.0), ("250ms", 0.25)])
def test_keep_alive_accepts_finite_durations(keep_alive, seconds):
    from supervisor.http.keepalive import keep_alive_seconds

    assert keep_alive_seconds(keep_alive, None) == seconds


def test_huge_ttl_is_400():
    from supervisor.http.keepalive import keep_alive_seconds
    from supervisor.http.openai_types import BodyError

    with pytest.raises(BodyError, match="ttl"):
        keep_alive_seconds(None, 10 ** 30)


def test_the_open_file_limit_is_raised_and_a_reserve_kept():
    from supervisor.http.connection_limits import FD_RESERVE, connection_cap, raise_fd_limit

    soft, hard = raise_fd_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
    assert soft == min(hard, 1 << 20) or hard == resource.RLIM_INFINITY
    assert connection_cap(1024, 1024) == 1024 - FD_RESERVE
    assert connection_cap(1024, 1 << 20) == 1024


def test_a_repeated_log_line_passes_once_a_window_with_a_count():
    from supervisor.http.connection_limits import RepeatFilter

    logger = logging.getLogger("memvisor.test.repeat")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    logger.addFilter(RepeatFilter(window=0.2))
    logger.propagate = False
    for n in range(500):
        logger.warning("client %s sent garbage", n)
    logger.warning("another line")
    time.sleep(0.25)
    logger.warning("client %s sent garbage", "last")
    assert seen[:2] == ["client 0 sent garbage", "another line"]
    assert seen[2].startswith("client last sent garbage (499 more like this")
    assert len(seen) == 3
