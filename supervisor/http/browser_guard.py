"""The gate in front of every route: the browser is a client, not an admin.

A page in the user's browser can reach a loopback port as easily as curl can,
and before this gate it could: a `text/plain` POST of `{"enabled": false}` to
/admin/guard from any web page turned the guard off (a "simple request" needs
no CORS preflight), and a page on a rebinding domain (evil.example resolving to
127.0.0.1) read /status and changed the tier. The gate checks, in order, on
every request:

1. **Host** must name this server: a loopback name (`localhost`,
   `*.localhost`, `127.x.x.x`, `[::1]`) on any port, the configured bind
   address, or, when bound to every interface, an IP literal or this machine's
   own host name. A rebinding page's requests carry its own domain as Host, so
   they stop here (421 Misdirected Request).
2. **Origin**, when a request carries one (browsers send it on every
   cross-origin request and on every POST): a request that is not a plain read
   (anything but GET/HEAD/OPTIONS) from an origin that is neither this server
   itself nor in `[supervisor] cors_origins` is refused (403).
3. **Content-Type**: a generation POST, and any other POST that carries a body
   or comes from a page, must declare `application/json` (415). A page can
   only send JSON cross-origin after a preflight, which the allowlist answers,
   so no page can slip a state change past CORS as `text/plain` or a form.
   One exception, for curl and scripts: Ollama's read and generation routes
   (`OLLAMA_ANY_CONTENT_TYPE`) take a JSON body under any content type when the
   request carries no Origin, as Ollama itself does (its own docs call
   `curl http://localhost:11434/api/chat -d '{...}'`, which sends a form's
   content type). Browsers send Origin on every POST, so a page never meets the
   exception, and Ollama's admin routes (`/api/pull`, `/api/delete`) keep the rule.
4. **CORS** for /v1/*, /api/* (the Ollama-style routes) and the API routes without
   a prefix (`/chat/completions`, `/models`, `/tokenize`, ...): a preflight from an
   allowed origin gets 204 with the methods and headers; a response to an
   allowed origin gets `Access-Control-Allow-Origin` echoing it; a disallowed
   origin gets no CORS headers at all, so its page cannot read the answer.

Who may administer is decided in auth.py (`require_admin`) with `same_origin`
from here: with no admin token, only loopback tools that send no Origin and
this server's own dashboard.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Callable

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from supervisor.http.errors import ApiError

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/infill",
                              "/chat/completions", "/completions", "/messages"})
CORS_PREFIXES = ("/v1/", "/api/")
# The API routes outside those prefixes: the /v1 routes that clients leaving
# out the prefix reach too, and llama.cpp's token and infill routes. A browser client of them
# needs the same CORS as /v1 gives, and gets no more.
CORS_PATHS = frozenset({"/models", "/chat/completions", "/completions", "/messages", "/messages/count_tokens",
                        "/embeddings", "/tokenize", "/detokenize", "/infill"})
# Ollama's routes that read a JSON body whatever its declared type when no Origin comes with it
# (curl -d, scripts): none of them administers; what a body there may do, keep_alive 0's unload
# included, is decided by the route as for any client (http/keepalive.py).
OLLAMA_ANY_CONTENT_TYPE = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# What the OpenAI and Anthropic browser SDKs send; a preflight's own list is echoed too.
ALLOW_HEADERS = ["authorization", "content-type", "x-api-key", "anthropic-version"]
EXPOSE_HEADERS = "Retry-After, WWW-Authenticate"
PREFLIGHT_MAX_AGE = "600"

_DEFAULT_PORT = {"http": 80, "https": 443}
_TOKEN_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]{1,64}$")  # a header name, as a preflight may list it
_HOST_RE = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<name>[^:\[\]/@\s]+))(?::(?P<port>[0-9]{1,5}))?$")


# ---------------------------------------------------------------------------
# names


def split_host(value: str) -> tuple[str, int | None] | None:
    """`Host` header -> (lower-case name without brackets, port or None); None if malformed."""
    match = _HOST_RE.match(value.strip())
    if match is None:
        return None
    name = (match["v6"] or match["name"]).lower().rstrip(".")
    port = int(match["port"]) if match["port"] else None
    return name, port


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    addr = _ip(name)
    return addr is not None and addr.is_loopback


class HostCheck:
    """Which Host names are this server (the DNS-rebinding defence).

    Ports are not compared: a port forward or a proxy may change the port, and
    the name is what a rebinding page cannot fake."""

    def __init__(self, bind_host: str) -> None:
        bind = bind_host.strip("[]").lower()
        addr = _ip(bind)
        self.wildcard = bind == "" or (addr is not None and addr.is_unspecified)
        self.names = {bind}
        if self.wildcard or not is_loopback_name(bind):  # reachable from elsewhere: by this machine's name too
            own = socket.gethostname().lower().rstrip(".")
            self.names |= {own, own.split(".")[0] + ".local"}

    def allowed(self, value: str) -> bool:
        parsed = split_host(value)
        if parsed is None:
            return False
        name = parsed[0]
        if is_loopback_name(name) or name in self.names:
            return True
        return self.wildcard and _ip(name) is not None


# ---------------------------------------------------------------------------
# origins


def _compile(pattern: str) -> re.Pattern[str]:
    if pattern == "*":
        return re.compile(r".*")
    body = re.escape(pattern.lower())
    if body.endswith(r":\*"):  # any port, or none
        body = body[: -len(r":\*")] + r"(?::[0-9]{1,5})?"
    return re.compile(body.replace(r"\*", r"[^/:\[\]]*"))


class OriginAllowlist:
    """`[supervisor] cors_origins`: exact origins or patterns with `*`."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = [_compile(p) for p in patterns]

    def allowed(self, origin: str) -> bool:
        origin = origin.strip().lower()
        return any(p.fullmatch(origin) for p in self.patterns)


def _origin_tuple(origin: str) -> tuple[str, str, int] | None:
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORT:
        return None
    parsed = split_host(rest)
    if parsed is None:
        return None
    name, port = parsed
    return scheme, name, port if port is not None else _DEFAULT_PORT[scheme]


def same_origin(scope: Scope) -> bool:
    """The request's Origin is this server as the browser addressed it (the dashboard's own page)."""
    headers = Headers(scope=scope)
    origin, host = headers.get("origin"), headers.get("host")
    if origin is None or host is None:
        return False
    page = _origin_tuple(origin)
    scheme = scope.get("scheme", "http")
    here = _origin_tuple(f"{scheme}://{host}")
    return page is not None and page == here


# ---------------------------------------------------------------------------
# the middleware


def is_json(content_type: str | None) -> bool:
    """`application/json`, parameters (charset) allowed."""
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "application/json"


def _has_body(headers: Headers) -> bool:
    return headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers


class BrowserGate:
    """ASGI middleware: Host, Origin, Content-Type and CORS, before any route runs.

    `shape(path)` renders an ApiError in the error shape of the API the path
    belongs to (Anthropic's on /v1/messages, OpenAI's elsewhere)."""

    def __init__(self, app: ASGIApp, hosts: HostCheck, origins: OriginAllowlist,
                 shape: Callable[[str], Callable[[ApiError], Response]]) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = origins
        self.shape = shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path, method = scope.get("path", ""), scope.get("method", "GET")
        refusal = self.refusal(scope, headers, path, method)
        if refusal is not None:
            await self.shape(path)(refusal)(scope, receive, send)
            return
        origin = headers.get("origin")
        cors = path.startswith(CORS_PREFIXES) or path in CORS_PATHS
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            await self.preflight(scope, headers, path, cors)(scope, receive, send)
            return
        if not cors or origin is None:
            await self.app(scope, receive, send)
            return
        extra = [(b"vary", b"Origin")]
        if self.origins.allowed(origin) and not same_origin(scope):
            extra += [(b"access-control-allow-origin", origin.encode("latin-1")),
                      (b"access-control-expose-headers", EXPOSE_HEADERS.encode())]

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_cors)

    def refusal(self, scope: Scope, headers: Headers, path: str, method: str) -> ApiError | None:
        """The reason to refuse this request before it reaches a route, or None."""
        host = headers.get("host")
        if host is not None and not self.hosts.allowed(host):
            return ApiError(421, f"this server does not answer to the name {host!r}: use localhost, a loopback "
                                 "address or the address it listens on (a foreign Host header is how a "
                                 "DNS-rebinding page reaches a local server)", code="misdirected_request")
        if method in READ_METHODS:
            return None
        origin = headers.get("origin")
        if origin is not None and not same_origin(scope) and not self.origins.allowed(origin):
            return ApiError(403, f"requests from the page at {origin} may not change anything here; "
                                 "add that origin to [supervisor] cors_origins to let it use /v1",
                            code="origin_not_allowed")
        content_type = headers.get("content-type")
        if origin is None and path in OLLAMA_ANY_CONTENT_TYPE:
            return None  # curl -d: the body is read as JSON, and is refused as bad JSON otherwise
        if not is_json(content_type) and (path in GENERATION_PATHS or origin is not None or _has_body(headers)):
            given = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return ApiError(415, f"{method} {path} takes a JSON body: send 'Content-Type: application/json' "
                                 f"(got {given})", code="unsupported_media_type")
        return None

    def preflight(self, scope: Scope, headers: Headers, path: str, cors: bool) -> Response:
        """OPTIONS with Access-Control-Request-Method: 204 for an allowed origin on a CORS path."""
        origin = headers["origin"]
        if not cors or not (self.origins.allowed(origin) or same_origin(scope)):
            where = path if not cors else f"origin {origin}"
            return Response(status_code=403, headers={"Vary": "Origin"},
                            content=f"cross-origin requests are not allowed for {where}\n",
                            media_type="text/plain; charset=utf-8")
        asked = [h.strip().lower() for h in headers.get("access-control-request-headers", "").split(",")]
        allow = ALLOW_HEADERS + [h for h in asked[:32] if _TOKEN_RE.match(h) and h not in ALLOW_HEADERS]
        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": ", ".join(allow),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        })
