"""The front door served inside the arbiter's loop.

uvicorn serves the Starlette app as a task of the supervisor's own asyncio
loop, so a request reaches the pool, the gate and the enforcer with no
thread hop and no lock (docs/architecture.md: one loop). `start_http(sup)` binds first
(a taken port is a clear error, not uvicorn's sys.exit), starts uvicorn and
returns once it accepts, with the address it bound. `build_app(sup)` is the
ASGI app: the routes (app.py) behind the gate (browser_guard.py: Host, Origin,
Content-Type, CORS), inside `Instrumented`, which stamps the arrival time,
counts every answer and names this host and the serving worker on it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from supervisor.config import host_name
from supervisor.config_checks import parse_http
from supervisor.doors.api import Supervisor
from supervisor.http import routing
from supervisor.http.app import FrontDoor, error_shape, http_exception
from supervisor.http.browser_guard import BrowserGate, HostCheck, OriginAllowlist
from supervisor.http.connection_limits import GuardedH11, connection_cap, limit_logs, raise_fd_limit
from supervisor.http.metrics import Metrics

log = logging.getLogger("memvisor.http")


class FrontDoorError(RuntimeError):
    """The front door cannot start (address in use, bad host); the message says why."""


class Instrumented:
    """ASGI wrapper: stamps the arrival time, counts every answer and its latency, and
    names this host (and the worker that served) on every response, for a router in front."""

    def __init__(self, app, metrics: Metrics, host: Callable[[], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.host = host  # read per response: a reload may rename the host

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        scope["memvisor.started"] = started
        served = routing.begin(scope.get("headers", []))
        status, complete = 0, False

        async def tracked(message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  *routing.response_headers(served, self.host())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            # 499: the client left before the response ended (nginx's convention).
            self.metrics.answered(endpoint_label(scope.get("path", "")), status if complete else 499,
                                  time.monotonic() - started)


_FIXED = {"/health", "/status", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
          "/v1/messages", "/v1/responses", "/admin/guard", "/v1/events", "/", "/ui",
          "/v1/messages/count_tokens", "/chat/completions", "/completions", "/models", "/messages",
          "/messages/count_tokens", "/api/version", "/api/tags", "/api/ps", "/api/show", "/api/chat",
          "/api/generate", "/v1/embeddings", "/embeddings", "/api/embed", "/api/embeddings", "/tokenize",
          "/detokenize", "/infill"}


def endpoint_label(path: str) -> str:
    """A bounded label: model ids and stray paths do not each make a series."""
    if path in _FIXED:
        return path
    if path.startswith("/v1/models/"):
        for action in ("load", "unload"):
            if path.endswith("/" + action):
                return "/v1/models/{id}/" + action
        return "/v1/models/{id}"
    return "other"


def build_app(sup: Supervisor):
    """The ASGI app: Starlette routes behind the gate, inside the metrics wrapper."""
    door = FrontDoor(sup)
    app = Starlette(routes=door.routes(), exception_handlers={HTTPException: http_exception})
    host, _port = parse_http(sup.config.supervisor.http)
    gate = BrowserGate(app, HostCheck(host), OriginAllowlist(sup.config.supervisor.cors_origins), error_shape)
    return Instrumented(gate, door.metrics, lambda: host_name(sup.config))


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the arbiter owns SIGTERM/SIGINT."""

    task: asyncio.Task[None] | None = None  # the serving task, once started

    def capture_signals(self):
        import contextlib

        return contextlib.nullcontext()


def bind(host: str, port: int) -> socket.socket:
    """Bind before starting, so a taken port is a clear error, not uvicorn's sys.exit."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FrontDoorError(f"cannot resolve HTTP host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise FrontDoorError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def format_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_http(sup: Supervisor) -> tuple[EmbeddedServer, str]:
    """Serve the front door as a task of the running loop; returns once it accepts,
    with the "HOST:PORT" actually bound (port 0 picks a free one)."""
    scfg = sup.config.supervisor
    host, port = parse_http(scfg.http)
    limit_logs()
    soft, _hard = raise_fd_limit()
    cap = connection_cap(scfg.max_connections, soft)
    if cap < scfg.max_connections:
        log.warning("max_connections lowered from %d to %d: the open-file limit is %d", scfg.max_connections,
                    cap, soft)
    sock = bind(host, port)
    protocol = GuardedH11.configured(scfg.header_timeout, scfg.body_timeout, cap)
    config = uvicorn.Config(build_app(sup), lifespan="off", log_config=None, access_log=False,
                            server_header=False, timeout_graceful_shutdown=5, http=protocol)
    server = EmbeddedServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="memvisor-http")
    server.task = task
    while not server.started:
        if task.done():
            sock.close()
            raise FrontDoorError(f"the HTTP server stopped while starting: {task.exception()!r}")
        await asyncio.sleep(0.005)
    address = format_address(sock)
    log.info("front door listening on http://%s", address)
    return server, address
