"""What the front door tells a router, and what a router may ask of it.

- Every response names this host in `X-Memvisor-Host`, and a generation names
  the worker that served it in `X-Memvisor-Worker`: behind a router, a client
  (or the router's log) can tell which host and which process answered, or
  which host refused.
- `X-Memvisor-Max-Wait: SECONDS` on a generation request bounds how long it
  may wait before a worker takes it: for its model's load, in the memory
  queue (SPEC P3), or for a worker that has stopped answering. Past that it
  is refused at once with a 503, a `code` and `Retry-After` (and, during a
  load, the load's progress), so a router sends it to another host instead
  of holding it. Without the header a request waits as it always has: a
  plain client that does not retry gets its answer after the load, as
  Ollama's and LM Studio's clients expect.

The ASGI wrapper (server.Instrumented) opens one `Served` per request; the
generation path (generate.open_stream, shared by every API) reads it through
`current()`, so each door gets the header without a change of its own.
"""

from __future__ import annotations

import contextvars
import math

from supervisor.http.errors import ApiError

HOST_HEADER = "X-Memvisor-Host"
WORKER_HEADER = "X-Memvisor-Worker"
MAX_WAIT_HEADER = "x-memvisor-max-wait"
MAX_WAIT_LIMIT = 3600.0


class Served:
    """One request's routing facts: the header it sent, the worker that served it."""

    __slots__ = ("raw_max_wait", "worker")

    def __init__(self, raw_max_wait: str | None) -> None:
        self.raw_max_wait = raw_max_wait
        self.worker: str | None = None

    def max_wait(self) -> float | None:
        """The request's X-Memvisor-Max-Wait in seconds (None: absent); a 400 when unusable."""
        raw = self.raw_max_wait
        if raw is None:
            return None
        try:
            seconds = float(raw.strip())
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or not 0 <= seconds <= MAX_WAIT_LIMIT:
            raise ApiError(400, f"{MAX_WAIT_HEADER}: seconds from 0 to {MAX_WAIT_LIMIT:.0f}, got {raw[:40]!r}",
                           code="invalid_header", param=MAX_WAIT_HEADER)
        return seconds


_current: contextvars.ContextVar[Served | None] = contextvars.ContextVar("memvisor_served", default=None)


def begin(headers: list[tuple[bytes, bytes]]) -> Served:
    """The record of one HTTP request, from its raw ASGI headers; current until it ends."""
    raw = next((v.decode("latin-1") for k, v in headers if k.lower() == MAX_WAIT_HEADER.encode()), None)
    served = Served(raw)
    _current.set(served)
    return served


def current() -> Served:
    """This request's record (a fresh, empty one outside a request: tests, scripts)."""
    return _current.get() or Served(None)


def response_headers(served: Served, host: str) -> list[tuple[bytes, bytes]]:
    headers = [(HOST_HEADER.lower().encode(), host.encode("latin-1"))]
    if served.worker:
        headers.append((WORKER_HEADER.lower().encode(), served.worker.encode("latin-1", "replace")))
    return headers
