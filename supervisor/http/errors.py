"""The front door's error model: every failure is OpenAI-style JSON.

`{"error": {"message", "type", "param", "code"}}` with a status that says
who should act: 4xx the client (fix the request; 422: the model's files are
refused, the operator must fix them), 503 retry later (pressure,
a worker going away), 507 the operator (the model does not fit, SPEC A3),
500 us. oMLX users complained that memory refusals read like crashes; here a
refusal names the binding constraint and the remedy (the message comes from
admission, SPEC C6) and carries the figures as extra fields.

Nothing here ever puts a traceback in a response.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from shared import protocol as p
from shared.embedding import WRONG_MODEL_KIND
from shared.fim import FIM_UNSUPPORTED
from shared.vocab import ErrorCode, FailureCode
from supervisor.doors.refusals import NotReady, ServeError
from supervisor.http.openai_types import ErrorBody, ErrorDetail

_encoder = msgspec.json.Encoder()

# How long a client should wait before retrying a request the guard turned
# away mid-flight (pressure aborts, a model being unloaded).
RETRY_AFTER_ABORT = 2

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "permission_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
    507: "insufficient_memory_error",
}

# Every refusal body carries a machine-readable `code`; where a raise
# site names none, the status gives one, so a router never has to read words.
_CODE_BY_STATUS: dict[int, ErrorCode] = {
    400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
    405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "request_too_large",
    415: "unsupported_media_type", 421: "misdirected_request", 422: "unprocessable", 429: "model_at_capacity",
    500: "internal_error", 501: "not_implemented", 503: "unavailable", 504: "timeout",
    507: "insufficient_memory",
}

# A worker's terminal `Failed(code)` -> (HTTP status, Retry-After seconds or None).
_FAILED_STATUS: dict[FailureCode, tuple[int, int | None]] = {
    "prefill_memory_exceeded": (400, None),  # SPEC G1: the prompt does not fit
    "invalid_request": (400, None),
    "invalid_constraint": (400, None),  # a schema or grammar the worker cannot enforce
    "context_length_exceeded": (400, None),  # prompt + max_tokens over the context
    FIM_UNSUPPORTED: (400, None),  # a suffix for a model whose tokenizer has no FIM tokens
    WRONG_MODEL_KIND: (400, None),  # chat to an embedding model, or the reverse
    "invalid_image": (400, None),  # an image the worker's processor could not read (docs/vision.md)
    "model_lacks_vision": (400, None),  # images for a model that reads only text
    "memory_pressure": (503, RETRY_AFTER_ABORT),  # P6.3/P6.5 aborted it
    "model_unloading": (503, RETRY_AFTER_ABORT),
    "worker_exited": (503, RETRY_AFTER_ABORT),
    "aborted": (503, RETRY_AFTER_ABORT),
}


class ApiError(Exception):
    """Raised anywhere in a handler; turned into one error response."""

    def __init__(self, status: int, message: str, *, code: ErrorCode | None = None, param: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None,
                 extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code: ErrorCode = code or _CODE_BY_STATUS.get(status, "error")
        self.param = param
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)
        self.extra = extra or {}

    def detail(self) -> ErrorDetail:
        return ErrorDetail(message=self.message, type=_TYPE_BY_STATUS.get(self.status, "server_error"),
                           param=self.param, code=self.code, **self.extra)

    def tagged(self) -> dict:
        """`code` and `param` when set, then the extra figures: what the Ollama and Anthropic
        error shapes carry beside their message (the OpenAI shape has its own struct)."""
        fields: dict = {}
        if self.code:
            fields["code"] = self.code
        if self.param:
            fields["param"] = self.param
        fields.update(self.extra)
        return fields

    def body(self) -> bytes:
        return _encoder.encode(ErrorBody(error=self.detail()))

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def from_serve_error(exc: ServeError) -> ApiError:
    """A refusal (load, queue, request size) -> its status; a 503 says when to retry."""
    retry = exc.retry_after
    if retry is None and exc.http_status == 503 and not exc.permanent:
        retry = RETRY_AFTER_ABORT
    extra = {"progress": exc.progress} if isinstance(exc, NotReady) and exc.progress is not None else None
    return ApiError(exc.http_status, str(exc), code=exc.code, retry_after=retry, extra=extra)


def from_failed(msg: p.Failed) -> ApiError:
    """A worker's terminal error for one request."""
    status, retry = _FAILED_STATUS.get(msg.code, (500, None))
    extra = {}
    if msg.binding or msg.estimated_bytes or msg.limit_bytes:
        extra = {"binding": msg.binding, "estimated_bytes": msg.estimated_bytes, "limit_bytes": msg.limit_bytes}
    return ApiError(status, msg.message or msg.code, code=msg.code, retry_after=retry, extra=extra)
