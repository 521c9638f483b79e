"""The checks a configuration value passes where it enters (docs/configuration.md): sizes,
durations, number ranges, model ids, `HOST:PORT`, CORS origin patterns.

Apart from supervisor/config.py because these are the words each section's `__post_init__`
speaks, and some are spoken outside the config too: a discovered or pulled model's id
(`check_model_id`), `serve --http` and the front door (`parse_http`). A failed check raises
`FieldError`, which msgspec joins to the key path (`guard.budget: ...`); the reader
(supervisor/config_file.py) turns that into a `ConfigError`.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

import msgspec

from shared.sizes import SizeError, parse_size


class FieldError(ValueError):
    """Raised inside `__post_init__`: `field` is joined to msgspec's path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")


# A duration: float seconds once built; the file may also write "10m", "90s", "1h30m"
# (shared.durations, the grammar keep_alive takes). `_read_durations` turns those into
# seconds before msgspec checks the types, so the field stays a plain float for its readers.
Seconds = Annotated[float, msgspec.Meta(extra={"duration": True})]


def checked_size(field: str, value: int | str) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise FieldError(field, str(exc)) from None


def non_negative(field: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise FieldError(field, f"must be zero or a positive number of seconds, got {value!r}")


def between(field: str, value: float, low: float, high: float, unit: str = "seconds") -> None:
    """A number in [low, high]: values that parse but break the system at run
    time (a heartbeat every nanosecond, 10**20 concurrent requests) are refused
    here, with the key path, not found by a traceback later."""
    if not (math.isfinite(value) and low <= value <= high):
        raise FieldError(field, f"must be between {low:g} and {high:g} {unit}, got {value!r}")


# Model ids travel in URL paths (`/v1/models/{id}/load`): letters, digits and
# `._:@+-`, segments joined by `/` (Hugging Face style `org/name`), and no id
# may end in a segment the routes use (`a/load` would be the load route of `a`).
MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*(/[A-Za-z0-9][A-Za-z0-9._:@+-]*)*$")
MODEL_ID_MAX = 128
_ROUTE_WORDS = frozenset({"load", "unload"})


def check_model_id(model_id: str) -> str | None:
    """Why `model_id` cannot be carried by the routes, or None when it can."""
    if not MODEL_ID_RE.match(model_id):
        return (f"{model_id!r} is not a usable model id: use letters, digits and ._:@+- "
                "(segments joined by /, each starting with a letter or digit)")
    if len(model_id) > MODEL_ID_MAX:
        return f"must be at most {MODEL_ID_MAX} characters, got {len(model_id)}"
    if "/" in model_id and model_id.rsplit("/", 1)[1] in _ROUTE_WORDS:
        return f"{model_id!r} ends in a route word (/load, /unload): the HTTP routes could not tell it apart"
    return None


_HTTP_RE = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


def is_loopback(host: str) -> bool:
    """True for names that can only be reached from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# `[supervisor] cors_origins` by default: local pages on any port, as Ollama's OLLAMA_ORIGINS.
DEFAULT_CORS_ORIGINS = [f"{scheme}://{host}:*" for scheme in ("http", "https")
                        for host in ("localhost", "127.0.0.1", "[::1]")]
_ORIGIN_PATTERN_RE = re.compile(r"^(?:\*|null|[a-z][a-z0-9+.-]*://(?:\[[0-9a-fA-F:.*]+\]|[^:/\[\]\s]+)"
                                r"(?::(?:\*|[0-9]{1,5}))?)$")


def check_origin_pattern(pattern: str) -> str | None:
    """Why `pattern` is not a valid `cors_origins` entry (None when it is)."""
    if not _ORIGIN_PATTERN_RE.match(pattern):
        return (f"{pattern!r} is not an origin: write SCHEME://HOST[:PORT] with no path, "
                "'*' for a wildcard part (e.g. http://localhost:*), or '*' for every origin")
    return None


def parse_http(text: str) -> tuple[str, int]:
    """Split `HOST:PORT` (IPv6 as `[::1]:8000`); ValueError says what is wrong."""
    match = _HTTP_RE.match(text.strip())
    if match is None:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:8000, got {text!r}")
    port = int(match["port"])
    if not 0 <= port < 65536:  # 0: the OS picks a free port (tests; the bound one is reported)
        raise ValueError(f"port must be 1-65535 (or 0 for any free port), got {port}")
    return match["host"].strip("[]"), port
