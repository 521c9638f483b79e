"""Ollama's keep_alive and LM Studio's ttl: a request's wish for its model's idle timer.

0 unloads right after the request; a negative value keeps it loaded (P10's
0 = never), as Ollama does; none leaves the configured timer alone. Parsed
strictly and before any generation starts: "inf" was a 500 that left a
generation running for nobody and "nan" meant "unload now", so only finite
values up to MAX_KEEP_ALIVE pass.

A timer is not an unload: P10 never expires a pinned model, whoever asks. Ollama's
`keep_alive: 0` with no prompt is an unload, and goes through the supervisor's one
unload (`Supervisor.unload`, its rule in service.py `unload_refusal`) with `is_admin`
saying who asks: an API key alone could unload a pinned model there that the
admin route refused it (docs/access.md).
"""

from __future__ import annotations

import math

from starlette.requests import Request

from shared.durations import DurationError, parse_duration
from supervisor.doors.api import UNLOAD_WHEN_IDLE
from supervisor.http.auth import require_admin
from supervisor.http.errors import ApiError
from supervisor.http.openai_types import BodyError


def is_admin(request: Request, admin_token: str) -> bool:
    """Whether the admin route would let this request in (http/auth.py `require_admin`):
    every door's unload asks the same question."""
    try:
        require_admin(request, admin_token)
    except ApiError:
        return False
    return True


def keep_alive_seconds(keep_alive, ttl: int | None) -> float | None:
    """Ollama's keep_alive / LM Studio's ttl -> the model's idle timer in seconds.

    0 unloads right after the request; a negative value keeps it loaded (P10's
    0 = never), as Ollama does; None leaves the configured timer alone. Parsed
    strictly and before any generation starts: "inf" was a 500 that
    left a generation running for nobody and "nan" meant "unload now", so only
    finite values up to MAX_KEEP_ALIVE pass."""
    if keep_alive is None and ttl is None:
        return None
    if keep_alive is None:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 <= ttl <= MAX_KEEP_ALIVE:
            raise BodyError(f"ttl: whole seconds from 0 to {MAX_KEEP_ALIVE:.0f}, got {ttl!r}", param="ttl")
        seconds: float = ttl
    elif isinstance(keep_alive, (int, float)) and not isinstance(keep_alive, bool):
        seconds = _bounded(float(keep_alive), keep_alive)
    elif isinstance(keep_alive, str):
        seconds = _bounded(_duration(keep_alive), keep_alive)
    else:
        raise BodyError(f"keep_alive: seconds or a duration like \"5m\", got {keep_alive!r}", param="keep_alive")
    if seconds < 0:
        return 0.0  # never expires
    return seconds if seconds > 0 else UNLOAD_NOW


UNLOAD_NOW = UNLOAD_WHEN_IDLE  # P10 expires an idle model whose idle time exceeds its TTL: at once
MAX_KEEP_ALIVE = 10 * 365 * 86400.0  # ten years: longer is "forever", which is spelled -1


def _bounded(seconds: float, given: object) -> float:
    """A finite number of seconds no longer than MAX_KEEP_ALIVE either way; BodyError otherwise."""
    if not math.isfinite(seconds) or abs(seconds) > MAX_KEEP_ALIVE:
        raise BodyError(f"keep_alive: {given!r} is not a usable duration: give finite seconds up to "
                        f"{MAX_KEEP_ALIVE:.0f} (ten years), or -1 to keep the model loaded",
                        param="keep_alive")
    return seconds


def _duration(text: str) -> float:
    """"5m", "1h30m", "90s", "-1", "0" (Go durations, as Ollama takes them): the one grammar
    of shared.durations, which the config's durations read too."""
    try:
        return parse_duration(text)
    except DurationError:
        raise BodyError(f"keep_alive: {text!r} is not a duration like \"5m\", \"1h\", \"0\" or \"-1\"",
                        param="keep_alive") from None
