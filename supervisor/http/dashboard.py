"""The dashboard at / (and /ui): a page, a script and a style sheet, served from the package.

No build step and no CDN: the machine may be offline, so the four files in
`supervisor/http/static/` are all there is. The page follows GET /v1/events
with EventSource and draws its chart with plain canvas (why not a charting
library: a time series with a ceiling, two watermarks, a handful of lines and
event marks is ~200 lines of canvas; a vendored library would be more code
than that to keep up to date, and still need our own event marks).

`GET /ui/session` tells the page what this client may do: load, unload and
the guard switch need admin (this page from a loopback client, or the admin
token when one is set; the page sends the token the user typed as a Bearer
header, never in a URL). With `[supervisor] api_keys` the event stream needs
a key too: the page trades the key it was given (as a header) for a ticket
cookie at `POST /ui/ticket`, since EventSource cannot send headers and no secret belongs in a URL.
"""

from __future__ import annotations

from importlib import resources
from typing import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared.protocol import TOPICS
from shared.vocab import TIERS
from supervisor.doors.api import Supervisor
from supervisor.http.auth import ApiKeys, EventTickets, Handler
from supervisor.http.errors import ApiError

STATIC = {  # name -> media type; nothing else under /ui/ is served
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "axis.js": "text/javascript; charset=utf-8",  # the chart's y axis (chartAxis), apart so a test runs it
    "dashboard.css": "text/css; charset=utf-8",
}


# Same-origin only: the page loads nothing from elsewhere and runs no inline code.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

_encoder = msgspec.json.Encoder()


class ModelEntry(msgspec.Struct, kw_only=True):
    id: str
    pinned: bool
    ttl: float       # seconds idle before P10 unloads it; 0 = never


class Session(msgspec.Struct, kw_only=True):
    admin: bool            # this client may load, unload and switch the guard
    token_required: bool   # admin needs the admin token (none given, or a wrong one)
    key_required: bool     # the event stream needs an API key (or the admin token) and has no ticket yet
    drills: bool
    tiers: list[str]
    topics: list[str]
    models: list[ModelEntry]


def read_static(name: str) -> bytes:
    return resources.files("supervisor.http").joinpath("static", name).read_bytes()


class Dashboard:
    def __init__(self, sup: Supervisor, may_admin: Callable[[Request], bool], keys: ApiKeys,
                 tickets: EventTickets) -> None:
        self.sup = sup
        self.may_admin = may_admin
        self.keys = keys
        self.tickets = tickets
        self.files = {name: read_static(name) for name in STATIC}  # a handful of KB, read once

    async def page(self, request: Request) -> Response:
        return self._file("dashboard.html")

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise ApiError(404, f"no such file: /ui/{name}", code="unknown_endpoint")
        return self._file(name)

    def _file(self, name: str) -> Response:
        return Response(self.files[name], media_type=STATIC[name], headers=SECURITY_HEADERS)

    async def session(self, request: Request) -> Response:
        cfg = self.sup.config
        admin = self.may_admin(request)
        models = [ModelEntry(id=m.id, pinned=m.pinned,
                             ttl=0.0 if m.pinned else (m.ttl if m.ttl is not None else cfg.supervisor.idle_timeout))
                  for m in cfg.models]
        body = Session(admin=admin, token_required=bool(cfg.supervisor.admin_token) and not admin,
                       key_required=self.keys.enabled and not self._keyed(request),
                       drills=cfg.supervisor.allow_drills, tiers=list(TIERS), topics=list(TOPICS), models=models)
        return Response(_encoder.encode(body), media_type="application/json", headers={"Cache-Control": "no-store"})

    def _keyed(self, request: Request) -> bool:
        try:
            self.keys.check(request)
        except ApiError:
            return False
        return True

    async def ticket(self, request: Request) -> Response:
        """POST /ui/ticket with the key as a header -> 204 and the /v1/events cookie (EventTickets)."""
        if not self.keys.enabled:
            return Response(status_code=204, headers={"Cache-Control": "no-store"})
        self.keys.check(request)
        return Response(status_code=204, headers={"Cache-Control": "no-store",
                                                  "Set-Cookie": self.tickets.cookie(self.tickets.issue())})

    def routes(self, wrap: Callable[[Handler], Handler]) -> list[Route]:
        return [
            Route("/ui/ticket", wrap(self.ticket), methods=["POST"]),
            Route("/", wrap(self.page), methods=["GET"]),
            Route("/ui", wrap(self.page), methods=["GET"]),
            Route("/ui/session", wrap(self.session), methods=["GET"]),
            Route("/ui/{name}", wrap(self.static), methods=["GET"]),
        ]
