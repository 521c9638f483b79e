"""One error base for everything the supervisor refuses on someone's behalf.

A load that cannot happen, a queue that is full, a request too large for a
worker: each door (HTTP, the control socket) answers them the same way, so
each carries its API `code`, the HTTP status that says who should act, and
when a retry makes sense. The doors translate; they never guess from text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.vocab import ErrorCode

if TYPE_CHECKING:
    from supervisor.doors.views import LoadProgress


class ServeError(RuntimeError):
    """A refusal with its API code, HTTP status and (for 503s) Retry-After seconds."""

    code: ErrorCode = "internal_error"
    http_status = 500

    def __init__(self, message: str, *, code: ErrorCode | None = None, http_status: int | None = None,
                 retry_after: int | None = None, permanent: bool = False) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if http_status is not None:
            self.http_status = http_status
        self.retry_after = retry_after
        # A 503 that a retry will not cure (the operator must act): it carries
        # no Retry-After, which would invite clients to retry for ever.
        self.permanent = permanent


class LoadError(ServeError):
    """A model could not be brought up, or its worker could not take the request."""

    code: ErrorCode = "load_failed"
    http_status = 500


class GateClosed(ServeError):
    """SPEC P3's queue is full or a request waited past its deadline (503)."""

    code: ErrorCode = "overloaded"
    http_status = 503


class ModelUnreadable(LoadError):
    """A configured model whose files are refused (not a regular file, over a size
    cap, a header that lies, no tensor data): 422, naming the file and the reason.

    Why 422 (not 500, which says "our bug"): the request is well
    formed (not 400) and names a model this server has (not 404), but that
    model cannot be processed as it stands; no retry cures it (not 503) until
    the operator fixes the files. A passing failure of the read (EMFILE) is a
    503 with Retry-After instead, raised elsewhere."""

    code: ErrorCode = "model_unreadable"
    http_status = 422


class AtCapacity(ServeError):
    """The model runs `max_concurrency` requests and `max_queue` more wait (429).

    Why 429 and not 503: nothing is wrong with this host's memory or its
    worker; this model is busy here, and a router should send the request to
    another host now (LiteLLM cools a deployment down for Retry-After seconds
    on a 429 and retries elsewhere at once)."""

    code: ErrorCode = "model_at_capacity"
    http_status = 429


class NotReady(ServeError):
    """The model cannot take the request without a wait the client said it will not
    make (`X-Memvisor-Max-Wait`): loading, paused by memory pressure, or a worker that
    has stopped answering. 503 with Retry-After; `progress` while it loads."""

    http_status = 503

    def __init__(self, message: str, *, code: ErrorCode, retry_after: int,
                 progress: LoadProgress | None = None) -> None:
        super().__init__(message, code=code, retry_after=retry_after)
        self.progress = progress
