"""Who may call what: API keys for /v1/*, and who may administer.

API keys: `[supervisor] api_keys` and/or `api_keys_file`.

When any key is configured, every /v1 call must carry one, as OpenAI clients
send it (`Authorization: Bearer KEY`) or as Anthropic's do (`x-api-key: KEY`);
anything else is a 401 in the calling API's error shape (the handler's
`guarded` wrapper renders it). /health, /status, /metrics and the dashboard
stay open: they are for the operator's tools, which carry no client key.

Keys are compared in constant time: each given key and each configured key
are hashed (SHA-256, so lengths leak nothing either) and every configured
key is compared, with no early exit. Keys are kept only as digests and are
never logged; a refusal names no key.

Each key is also its own prompt-cache partition (SPEC H7 as proposed,
http/partitions.py): a keyed request runs with the partition named by an HMAC
of its key under the server's secret, so no key's `cached_tokens` can tell what
another key sent.

Who may administer (load, unload, /admin/guard): with `[supervisor]
admin_token` set, whoever sends `Authorization: Bearer <token>`; with none,
a loopback client that sends no `Origin` (curl, scripts, SDKs) or this
server's own dashboard (its Origin is this server). A page from any other
origin, even one in `cors_origins` and even on loopback, needs the token: a
browser is a client, not an admin (`require_admin`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from pathlib import Path
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from shared.protocol import SHARED_PARTITION
from supervisor.http import partitions
from supervisor.http.browser_guard import same_origin
from supervisor.http.errors import ApiError

Handler = Callable[[Request], Awaitable[Response]]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str) -> list[str]:
    """One key a line; blank lines and `#` comments skipped."""
    lines = Path(path).expanduser().read_text().splitlines()
    return [s for line in lines if (s := line.strip()) and not s.startswith("#")]


class ApiKeys:
    def __init__(self, keys: list[str], admin_token: str = "", secret: bytes | None = None) -> None:
        self._digests = [_digest(k) for k in keys if k]
        # The admin token also opens /v1 (it already opens the admin endpoints there).
        if admin_token and self._digests:
            self._digests.append(_digest(admin_token))
        # What names each key's prompt-cache partition; read (or made) only when keys are on.
        self._secret = (secret or partitions.server_secret()) if self._digests else b""

    @classmethod
    def from_config(cls, scfg) -> "ApiKeys":
        keys = list(scfg.api_keys)
        if scfg.api_keys_file:
            keys += read_keys_file(scfg.api_keys_file)
        return cls(keys, scfg.admin_token)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def valid(self, given: str) -> bool:
        probe = _digest(given)
        ok = False
        for d in self._digests:  # no early exit: the time does not say which key matched
            ok |= hmac.compare_digest(probe, d)
        return ok

    def check(self, request: Request, from_query: bool = False) -> str:
        """401 unless the request carries a configured key (or keys are off); the caller's
        prompt-cache partition (SHARED_PARTITION without keys).

        `from_query`: also `?api_key=` (only /v1/events: a browser's EventSource
        cannot send headers)."""
        if not self._digests:
            return SHARED_PARTITION
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        given = bearer.strip() if scheme.lower() == "bearer" else ""
        given = given or request.headers.get("x-api-key", "").strip()
        if from_query and not given:
            given = request.query_params.get("api_key", "").strip()
        if not given:
            raise ApiError(401, "this server needs an API key: send 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')", code="missing_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not self.valid(given):
            raise ApiError(401, "the API key is not valid for this server", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return partitions.partition_id(self._secret, given)

    def required(self, handler: Handler) -> Handler:
        """`handler` for callers with a key, run in the key's prompt-cache partition."""
        async def keyed(request: Request) -> Response:
            with partitions.serving(self.check(request)):
                return await handler(request)

        return keyed


class EventTickets:
    """Cookies that open GET /v1/events for the dashboard (no secret in any URL).

    EventSource cannot send headers, and a key in `?api_key=` lands in the
    browser's history and in any proxy's log. So the page trades the key it
    holds (sent as a header to POST /ui/ticket) for a random ticket in an
    HttpOnly, SameSite=Strict cookie scoped to /v1/events: it opens only that
    read-only stream, is never sent cross-site, and lives in memory only (a
    restart forgets it; the page asks again)."""

    COOKIE = "memvisor_events"
    TTL = 12 * 3600.0
    MAX = 256  # live tickets; the oldest is dropped beyond it

    def __init__(self) -> None:
        self._expiry: dict[bytes, float] = {}  # digest -> monotonic expiry

    def issue(self) -> str:
        now = time.monotonic()
        self._expiry = {d: t for d, t in self._expiry.items() if t > now}
        while len(self._expiry) >= self.MAX:
            del self._expiry[next(iter(self._expiry))]
        ticket = secrets.token_urlsafe(32)
        self._expiry[_digest(ticket)] = now + self.TTL
        return ticket

    def valid(self, ticket: str) -> bool:
        if not ticket:
            return False
        expiry = self._expiry.get(_digest(ticket))
        return expiry is not None and expiry > time.monotonic()

    def cookie(self, ticket: str) -> str:
        return (f"{self.COOKIE}={ticket}; Path=/v1/events; Max-Age={int(self.TTL)}; HttpOnly; "
                "SameSite=Strict")


# ---------------------------------------------------------------------------
# who may administer (load, unload, /admin/guard)


def is_loopback_client(host: str | None) -> bool:
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def require_admin(request: Request, token: str) -> None:
    """Bearer token when configured; otherwise loopback clients that are not a foreign page
    (no Origin, or this server's own origin: the dashboard): a page is not an admin."""
    if token:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(401, "this admin endpoint needs 'Authorization: Bearer <admin_token>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return
    client = request.client.host if request.client else None
    if not is_loopback_client(client):
        raise ApiError(403, f"admin endpoints accept only loopback clients (this one is {client}); "
                            "set [supervisor] admin_token to allow remote administration",
                       code="forbidden")
    origin = request.headers.get("origin")
    if origin is not None and not same_origin(request.scope):
        raise ApiError(403, f"a page from {origin} may not administer this server: with no [supervisor] "
                            "admin_token only loopback tools (which send no Origin) and this server's own "
                            "dashboard may; set admin_token and send 'Authorization: Bearer <token>'",
                       code="forbidden")
