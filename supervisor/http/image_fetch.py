"""Fetching an image URL for a request, when `[supervisor] fetch_image_urls` allows it.

Why so careful: a URL in a request body makes the server a client of the
sender's choosing. Left alone it would read the sender a cloud's metadata
service, a router's admin page or any port on the loopback (server-side
request forgery). So every hop is checked before it is taken: only http and
https, the name resolved here and every address it has public (no loopback,
private, link-local, shared, reserved or multicast address), and the
connection made to the address that was checked (the Host header and TLS's
server name stay the URL's, so certificates are verified as usual), so a DNS
answer that changes between check and connect cannot send us elsewhere. A
redirect is a new hop, checked the same way (at most `MAX_REDIRECTS`). The
body is read in pieces and the fetch stops at `max_bytes`; the whole fetch,
redirects included, has `timeout` seconds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

import httpx

MAX_REDIRECTS = 3
USER_AGENT = "memvisor-image-fetch"


class FetchError(Exception):
    """Why an image URL was not fetched, in words for the client."""


def public(address: str) -> bool:
    """An address any host on the internet could reach: not ours, not a private network's."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def _resolve(host: str, port: int, allowed: Callable[[str], bool]) -> str:
    """One checked address of `host` (every address it resolves to must be `allowed`: public)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FetchError(f"cannot resolve {host!r} ({exc.strerror or exc})") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise FetchError(f"cannot resolve {host!r}")
    private = [a for a in addresses if not allowed(a)]
    if private:
        raise FetchError(f"{host!r} resolves to a non-public address ({private[0]}); image URLs are fetched "
                         "only from public addresses")
    return addresses[0]


def _pinned(url: str, address: str) -> tuple[str, str, str]:
    """`url` pointed at `address`: (the URL to request, its Host header, the TLS server name)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    literal = f"[{address}]" if ":" in address else address
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    target = parts._replace(netloc=netloc).geturl()
    header = parts.netloc.rsplit("@", 1)[-1]  # no userinfo goes anywhere
    return target, header, host


async def fetch(url: str, max_bytes: int, timeout: float, allowed: Callable[[str], bool] = public) -> bytes:
    """The bytes at `url` (following at most MAX_REDIRECTS checked redirects); FetchError on anything else.
    `allowed` says which addresses may be connected to (public ones; tests widen it to a loopback server)."""
    deadline = time.monotonic() + timeout
    try:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            return await asyncio.wait_for(_hops(client, url, max_bytes, allowed), timeout=max(0.01, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise FetchError(f"fetching the image took longer than {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise FetchError(f"fetching the image failed ({type(exc).__name__}: {exc})") from None


async def _hops(client: httpx.AsyncClient, url: str, max_bytes: int, allowed: Callable[[str], bool]) -> bytes:
    for _hop in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError(f"only http(s) URLs are fetched (got {url[:100]!r})")
        address = await _resolve(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), allowed)
        target, host, server_name = _pinned(url, address)
        request = client.build_request("GET", target, headers={"Host": host, "User-Agent": USER_AGENT},
                                       extensions={"sni_hostname": server_name})
        response = await client.send(request, stream=True)
        try:
            if response.is_redirect:
                location = response.headers.get("location")
                if not location:
                    raise FetchError(f"a redirect ({response.status_code}) without a location")
                url = urljoin(url, location)
                continue
            if response.status_code != 200:
                raise FetchError(f"the image URL answered HTTP {response.status_code}")
            return await _body(response, max_bytes)
        finally:
            await response.aclose()
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


async def _body(response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise FetchError(f"the image is {declared} bytes, over the {max_bytes} an image may have "
                         "([supervisor] max_image_bytes)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise FetchError(f"the image is over the {max_bytes} bytes an image may have ([supervisor] max_image_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
