"""Fetching image URLs (supervisor/http/image_fetch.py) against a real HTTP server on loopback: only
public addresses, every redirect hop checked, the size and time caps."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from supervisor.http.image_fetch import FetchError, fetch, public
from tests.image_harness import image_bytes

PICTURE = image_bytes(32, 32, seed=1)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.hosts.append(self.headers["Host"])  # type: ignore[attr-defined]
        if self.path.startswith("/redirect/"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/redirect/").replace("~", "/"))
            self.end_headers()
        elif self.path.startswith("/hops/"):  # /hops/N redirects N times, then the image
            left = int(self.path.rsplit("/", 1)[1])
            self.send_response(302)
            self.send_header("Location", f"/hops/{left - 1}" if left > 1 else "/cat.png")
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(2)
            self._send(PICTURE)
        elif self.path == "/undeclared":  # no Content-Length: read until the cap
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PICTURE * 50)
            self.close_connection = True
        elif self.path == "/missing":
            self.send_response(404)
            self.end_headers()
        else:
            self._send(PICTURE)

    def _send(self, body: bytes) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except BrokenPipeError:  # the client gave up (the time cap)
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.hosts = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def loopback_only(address: str) -> bool:
    return address == "127.0.0.1"


def get(url: str, *, max_bytes: int = 1 << 20, timeout: float = 5.0, allowed=loopback_only) -> bytes:
    return asyncio.run(fetch(url, max_bytes, timeout, allowed=allowed))


def test_fetches_an_image_from_an_allowed_address_with_its_own_host_header(origin):
    port = origin.server_address[1]
    assert get(f"http://localhost:{port}/cat.png") == PICTURE
    assert origin.hosts[-1] == f"localhost:{port}"  # connected to the checked address, asked for the name


def test_loopback_and_private_addresses_are_refused_by_default(origin):
    port = origin.server_address[1]
    with pytest.raises(FetchError, match="non-public address"):
        get(f"http://127.0.0.1:{port}/cat.png", allowed=public)


def test_a_redirect_is_a_new_hop_checked_the_same_way(origin):
    port = origin.server_address[1]
    assert get(f"http://127.0.0.1:{port}/redirect/~cat.png") == PICTURE  # to an allowed address: followed
    with pytest.raises(FetchError, match="non-public address.*127.0.0.2"):
        get(f"http://127.0.0.1:{port}/redirect/http:~~127.0.0.2:{port}~cat.png")
    with pytest.raises(FetchError, match="only http"):
        get(f"http://127.0.0.1:{port}/redirect/file:~~~etc~passwd")


def test_at_most_three_redirects(origin):
    port = origin.server_address[1]
    assert get(f"http://127.0.0.1:{port}/hops/3") == PICTURE
    with pytest.raises(FetchError, match="more than 3 redirects"):
        get(f"http://127.0.0.1:{port}/hops/4")


def test_the_byte_cap_holds_whether_declared_or_not(origin):
    port = origin.server_address[1]
    with pytest.raises(FetchError, match=f"is {len(PICTURE)} bytes, over the 100"):
        get(f"http://127.0.0.1:{port}/cat.png", max_bytes=100)
    with pytest.raises(FetchError, match="over the 4096 bytes"):
        get(f"http://127.0.0.1:{port}/undeclared", max_bytes=4096)


def test_the_time_cap_and_an_error_status(origin):
    port = origin.server_address[1]
    with pytest.raises(FetchError, match="longer than 0.5 s"):
        get(f"http://127.0.0.1:{port}/slow", timeout=0.5)
    with pytest.raises(FetchError, match="HTTP 404"):
        get(f"http://127.0.0.1:{port}/missing")


@pytest.mark.parametrize("address, ok", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("192.168.1.1", False), ("172.16.0.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("::1", False), ("fe80::1%eth0", False), ("fd00::1", False), ("::ffff:127.0.0.1", False),
    ("224.0.0.1", False),
])
def test_public_addresses_only(address, ok):
    assert public(address) is ok
