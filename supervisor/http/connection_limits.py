"""Bounds on what one client may hold (a client is input): header and body deadlines, a connection cap,
descriptor headroom, and logs that a flood cannot grow without bound.

Before these, a client that opened connections and sent headers that never
ended held each one forever: uvicorn's `timeout_keep_alive` runs only between
requests, and h11's size limit bounds the bytes, not the time. The
connections used up every descriptor, after which nothing (not /health, not a
worker's pipe) could be opened, and each failed accept was logged.

`GuardedH11` is uvicorn's own h11 protocol with three additions:

- a **header deadline** (`[supervisor] header_timeout`): from the moment a
  connection opens, or its previous response ends, the client has that long to
  finish its request line and headers; then the connection gets a 408 and is
  closed;
- a **body deadline**: once the headers are in, the body must arrive within
  `body_timeout` (plus a second, so a route that reads its body answers its own
  408 first); this covers every route, including ones that never read a body;
- a **connection cap** (`[supervisor] max_connections`): a connection beyond it
  closes the oldest one that is still sending headers (or idling between
  requests); when every connection is busy with a request, the new one gets a
  503 at once and is closed. Either way no connection waits in a queue.

Timers are loop callbacks (`call_later`), one per connection, so an attack
costs the loop no polling.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from supervisor.http.errors import ApiError

log = logging.getLogger("memvisor.http")

# Descriptors kept free for everything that is not an HTTP client: workers'
# pipes and ZeroMQ sockets, model files, the control socket, logs.
FD_RESERVE = 256
# A route that reads its body answers its own 408 this long before the protocol closes the connection.
BODY_GRACE = 1.0


def _raw_response(status: int, reason: str, error: ApiError) -> bytes:
    body = error.body()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with header/body deadlines and a connection cap (module docstring)."""

    header_timeout: ClassVar[float] = 10.0
    body_timeout: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phase = "new"  # "headers" | "body" | "busy" | "closed"
        self.phase_since = time.monotonic()
        self.deadline: asyncio.TimerHandle | None = None
        self.partial = False  # part of a request arrived in this "headers" phase

    @classmethod
    def configured(cls, header_timeout: float, body_timeout: float, max_connections: int) -> type["GuardedH11"]:
        """A subclass with these settings (uvicorn builds protocols from a class, not an instance)."""
        return type("GuardedH11", (cls,), {"header_timeout": header_timeout, "body_timeout": body_timeout,
                                          "max_connections": max_connections})

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._evict_oldest():
            log.warning("%d HTTP connections are open ([supervisor] max_connections); "
                    "refusing new ones with 503", len(self.connections) - 1)
            self._close(_raw_response(503, "Service Unavailable", ApiError(
                503, f"this server has {self.max_connections} connections open, its limit "
                     "([supervisor] max_connections); retry shortly", code="too_many_connections")))
            return
        self._track()

    def data_received(self, data: bytes) -> None:
        self.partial = self.partial or (self.phase == "headers" and bool(data))
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.phase = "closed"
        super().connection_lost(exc)

    # -- deadlines -------------------------------------------------------------

    def _track(self) -> None:
        """Move to the phase h11's state says we are in; a new phase starts its own deadline."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else "busy"
        if phase == self.phase:
            return
        self._cancel()
        self.phase, self.phase_since, self.partial = phase, time.monotonic(), False
        if phase == "headers":
            self.deadline = self.loop.call_later(self.header_timeout, self._expired)
        elif phase == "body":
            self.deadline = self.loop.call_later(self.body_timeout + BODY_GRACE, self._expired)

    def _cancel(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.phase == "headers":
            log.warning("closed an HTTP connection from %s whose request headers did not "
                    "arrive within %g s ([supervisor] header_timeout)", self._peer(), self.header_timeout)
            answer = b""
            if self.partial:  # a client that sent nothing just idled: no 408 for it
                answer = _raw_response(408, "Request Timeout", ApiError(
                    408, f"the request headers did not arrive within {self.header_timeout:g} s "
                         "([supervisor] header_timeout)", code="request_timeout"))
            self._close(answer)
        elif self.phase == "body":
            log.warning("closed an HTTP connection from %s whose request body did not "
                    "arrive within %g s ([supervisor] body_timeout)", self._peer(), self.body_timeout)
            self._close(b"")

    def _evict_oldest(self) -> bool:
        """At the cap: close the connection that has waited longest for its headers (or idled
        longest between requests); False when every other connection is in a request."""
        waiting = [c for c in self.connections
                   if c is not self and isinstance(c, GuardedH11) and c.phase == "headers"]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.phase_since)
        log.warning("%d HTTP connections are open ([supervisor] max_connections): closed the one "
                "from %s, idle or sending headers for %.1f s", len(self.connections) - 1, oldest._peer(),
                time.monotonic() - oldest.phase_since)
        oldest._cancel()
        oldest._close(b"")
        return True

    def _close(self, answer: bytes) -> None:
        self._cancel()
        self.phase = "closed"
        if answer:
            self.transport.write(answer)
        self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "?"


# ---------------------------------------------------------------------------
# descriptors


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (macOS: at most OPEN_MAX); returns (soft, hard).

    The default soft limit (1024 on most Linux, 256 on macOS) is what a few
    hundred idle connections exhaust; the hard limit is usually far above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY or target > 1 << 20:
        target = 1 << 20
    if sys.platform == "darwin":
        target = min(target, 10240)  # OPEN_MAX: setrlimit refuses more
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft, hard


def connection_cap(configured: int, soft_limit: int) -> int:
    """`max_connections`, lowered so that FD_RESERVE descriptors (or a quarter) always stay free."""
    if soft_limit == resource.RLIM_INFINITY:
        return configured
    reserve = max(FD_RESERVE, soft_limit // 4)
    return min(configured, max(8, soft_limit - reserve))


# ---------------------------------------------------------------------------
# logs


class RepeatFilter(logging.Filter):
    """The same line (logger, level, format string) passes once per `window` seconds; the
    next one after the window says how many were held back. A flood of one error
    (a connection storm, a client retrying a bad request) then costs a line per
    window, not megabytes a minute."""

    def __init__(self, window: float = 10.0, max_keys: int = 1024) -> None:
        super().__init__()
        self.window = window
        self.max_keys = max_keys
        self.seen: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (window start, held back)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        start, held = self.seen.get(key, (-1e18, 0))
        if now - start < self.window:
            self.seen[key] = (start, held + 1)
            return False
        if len(self.seen) >= self.max_keys:
            self.seen.clear()
        self.seen[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} more like this in the last {now - start:.0f} s not logged)"
            record.args = None
        return True


_LIMITED_LOGGERS = ("memvisor.http", "uvicorn.error", "asyncio")


def limit_logs(window: float = 10.0) -> None:
    """Rate-limit the loggers an HTTP flood writes to (idempotent)."""
    for name in _LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter(window))
