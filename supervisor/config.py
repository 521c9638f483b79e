"""The supervisor's configuration: one TOML file with `[guard]`,
`[supervisor]` and `[[models]]` (docs/configuration.md).

Every value is checked where it enters: an unknown key, a wrong type, a bad
size or inconsistent thresholds raise `ConfigError` whose message starts with
the key path (`guard.soft_threshold: ...`), so a person can fix the file
without reading a traceback. `Config()` is the built-in demo's configuration.

Size fields accept what `shared.sizes.parse_size` accepts (`"1.5GiB"`,
`"1536MiB"`, `"2GB"` or integer bytes) and hold plain `int` bytes once built.
Duration fields (typed `Seconds`) accept what `shared.durations.parse_duration`
accepts (`"10m"`, `"90s"`, `"1h30m"` or a number of seconds), the grammar of
Ollama's `keep_alive`, and hold plain `float` seconds once built. An unknown
key is named with the key it may have meant (`models[0].pinnned: unknown key;
did you mean pinned?`).

Public names (stable): Config, GuardConfig, SupervisorConfig, ModelConfig,
ConfigError, config_from, load_config, parse_config, resolve_thresholds, normalise_tier,
parse_http.
"""

from __future__ import annotations

import difflib
import math
import re
import socket
from pathlib import Path
from typing import Annotated, Any, cast

import msgspec
import msgspec.inspect as mi

from shared.durations import DurationError, parse_duration
from shared.protocol import DISK_CACHE_AUTO, MAX_IMAGE_PAYLOAD
from shared.sizes import SizeError, parse_size
from shared.vocab import PrefillOrder, Tier
from supervisor.policy.snapshot import GuardSettings
from supervisor.policy.tiers import ThresholdError, check_thresholds, normalise_tier

__all__ = [
    "Config",
    "ConfigError",
    "GuardConfig",
    "ModelConfig",
    "SupervisorConfig",
    "config_from",
    "load_config",
    "parse_config",
    "guard_settings",
    "parse_http",
]


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key path."""


class _FieldError(ValueError):
    """Raised inside `__post_init__`: `field` is joined to msgspec's path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")


# A duration: float seconds once built; the file may also write "10m", "90s", "1h30m"
# (shared.durations, the grammar keep_alive takes). `_read_durations` turns those into
# seconds before msgspec checks the types, so the field stays a plain float for its readers.
Seconds = Annotated[float, msgspec.Meta(extra={"duration": True})]


def _size(field: str, value: int | str) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise _FieldError(field, str(exc)) from None


def _non_negative(field: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise _FieldError(field, f"must be zero or a positive number of seconds, got {value!r}")


def _between(field: str, value: float, low: float, high: float, unit: str = "seconds") -> None:
    """A number in [low, high]: values that parse but break the system at run
    time (a heartbeat every nanosecond, 10**20 concurrent requests) are refused
    here, with the key path, not found by a traceback later."""
    if not (math.isfinite(value) and low <= value <= high):
        raise _FieldError(field, f"must be between {low:g} and {high:g} {unit}, got {value!r}")


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


# A device ceiling below this is a unit slip (`custom_device_ceiling = 20` meant
# GiB) that would refuse every load, not a choice.
MIN_DEVICE_CEILING = 1024 ** 2


class GuardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[guard]`: the memory guard (SPEC T, C, P). Sizes in bytes once built."""

    enabled: bool = True
    tier: str = "balanced"           # T2: normalised here (a Tier once built); unknown -> an error
    custom_ceiling: int | str = 0    # C3: 0 = unset (not a candidate)
    custom_device_ceiling: int | str = 0  # D2: the device ceiling on the custom tier (0 = unset)
    soft_threshold: float | None = None  # T5: absent/<=0/0.85 -> tier default
    hard_threshold: float | None = None  # T5: absent/<=0/0.95 -> tier default
    budget: int | str = 0            # caps `total` (0 = none)
    # H2/C12: the prompt caches of all workers together (0 = no prompt cache).
    # 1 GiB: a long system prompt plus a few chats on a 7-8B model. C12 (2026-12-01)
    # reserves only what the caches hold, and H2 bounds the budget by a quarter of the
    # soft watermark, so the default also works under a small custom ceiling.
    hot_cache_max: int | str = 1024 ** 3
    pool_max: int | str = 2 * 1024 ** 3  # M1: MLX pool a worker may keep (mx.set_cache_limit)
    # H5 (docs/rules.md): the prompt cache's disk tier, every model's
    # entries together. "auto": a quarter of the cache folder's free disk (plus what the tier
    # holds), measured by the worker that writes; 0 = off. Kept as int bytes, -1 for "auto".
    disk_cache_max: int | str = "auto"
    disk_cache_grace: Seconds = 2.0    # H5: seconds a stopping worker may write its cache (0 = none)
    cache_quantize_bits: int = 0     # H6: 8 or 4 quantizes unused entries at soft pressure; 0 = off
    safe_zone_ratio: float = 0.89    # G2
    min_chunk_tokens: int = 256      # G2
    # M2 (revised 2026-12-05): macOS workers wire nothing unless this opts in (mx.set_wired_limit
    # under concurrent requests is the reproduced trigger of an IOGPU kernel panic, mlx#3186)
    wire_weights: bool = False
    poll_interval: Seconds = 1.0       # P9 active cadence
    loaded_idle_interval: Seconds = 10.0
    unloaded_idle_interval: Seconds = 30.0
    # W5: non-pinned models that evict each other more than thrash_swaps times within
    # thrash_window seconds thrash; a load among them then lets the loaded model serve its
    # queued requests for up to thrash_hold seconds before the swap (0 = no hold and no
    # hand-over: a load is admitted as before W5). docs/thrash-and-prefetch.md
    thrash_swaps: int = 3
    thrash_window: Seconds = 60.0
    thrash_hold: Seconds = 2.0
    # W4: with room and no pressure, read ahead (page cache only) the weights of the model most
    # likely to be asked for next
    prefetch: bool = True

    def __post_init__(self) -> None:
        self.custom_ceiling = _size("custom_ceiling", self.custom_ceiling)
        self.custom_device_ceiling = _size("custom_device_ceiling", self.custom_device_ceiling)
        if 0 < self.custom_device_ceiling < MIN_DEVICE_CEILING:
            raise _FieldError("custom_device_ceiling", f"must be 0 (unset) or at least 1MiB, got "
                              f"{self.custom_device_ceiling} bytes (a bare number is bytes: write e.g. \"20GiB\")")
        self.budget = _size("budget", self.budget)
        self.hot_cache_max = _size("hot_cache_max", self.hot_cache_max)
        self.pool_max = _size("pool_max", self.pool_max)
        if isinstance(self.disk_cache_max, str) and self.disk_cache_max.strip().lower() == "auto":
            self.disk_cache_max = DISK_CACHE_AUTO
        elif self.disk_cache_max != DISK_CACHE_AUTO:  # -1: a config built before ("auto"), checked again
            self.disk_cache_max = _size("disk_cache_max", self.disk_cache_max)
        _between("disk_cache_grace", self.disk_cache_grace, 0.0, 60.0)
        if self.cache_quantize_bits not in (0, 4, 8):
            raise _FieldError("cache_quantize_bits", f"must be 0 (off), 4 or 8, got {self.cache_quantize_bits}")
        tier, known = normalise_tier(self.tier)
        if not known:
            raise _FieldError("tier", f"unknown tier {self.tier!r}: choose safe, balanced, aggressive or custom")
        self.tier = tier  # T2, once, where the name enters: the guard reads a Tier
        for name in ("soft_threshold", "hard_threshold"):
            value = getattr(self, name)
            if value is not None and math.isfinite(value) and value < 0:
                raise _FieldError(name, f"must not be negative, got {value!r} (leave it out or 0 for the "
                                        "tier default)")
        try:
            check_thresholds(tier, self.soft_threshold, self.hard_threshold)
        except ThresholdError as exc:
            raise _FieldError(exc.key, exc.reason) from None
        if not (math.isfinite(self.safe_zone_ratio) and 0 < self.safe_zone_ratio <= 1):
            raise _FieldError("safe_zone_ratio", f"must be in (0, 1], got {self.safe_zone_ratio!r}")
        if not 1 <= self.min_chunk_tokens <= 1_000_000:
            raise _FieldError("min_chunk_tokens", f"must be 1..1000000, got {self.min_chunk_tokens}")
        for name in ("poll_interval", "loaded_idle_interval", "unloaded_idle_interval"):
            _between(name, getattr(self, name), 0.01, 3600.0)
        _between("thrash_swaps", self.thrash_swaps, 1, 1000, "swaps")
        _between("thrash_window", self.thrash_window, 1.0, 86400.0)
        _between("thrash_hold", self.thrash_hold, 0.0, 60.0)


# (key, low, high) in seconds: below `low` a loop spins (a heartbeat every
# nanosecond took 98% CPU and killed a pinned model 4 times in 12 s).
_SUPERVISOR_RANGES = (
    ("queue_deadline", 0.01, 86400.0), ("restart_period", 0.1, 86400.0), ("stop_grace", 0.01, 3600.0),
    ("heartbeat_interval", 0.05, 3600.0), ("heartbeat_timeout", 0.1, 86400.0), ("load_timeout", 0.1, 86400.0),
    ("step_timeout", 0.1, 86400.0), ("failed_retry_first", 0.1, 86400.0),
    ("failed_retry_max", 0.1, 86400.0), ("body_timeout", 0.1, 3600.0), ("header_timeout", 0.1, 3600.0),
)


MAX_SPARE_WORKERS = 16  # each holds a Python with MLX imported; more wait for nothing


class SupervisorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[supervisor]`: the front door, the pool and the bus."""

    http: str = "127.0.0.1:8000"
    idle_timeout: Seconds = 0.0        # P10 global TTL in seconds (0 = never)
    allow_drills: bool = False
    admin_token: str = ""
    # when any is set, /v1/* needs one (Bearer or x-api-key); a file has one a line
    api_keys: list[str] = msgspec.field(default_factory=list)
    api_keys_file: str = ""
    queue_size: int = 64
    queue_deadline: Seconds = 60.0
    restart_max: int = 3
    restart_period: Seconds = 60.0
    stop_grace: Seconds = 10.0
    heartbeat_interval: Seconds = 1.0
    heartbeat_timeout: Seconds = 5.0
    load_timeout: Seconds = 600.0      # a worker still loading after this long is wedged
    # A worker whose step loop is inside one engine step (its heartbeat thread
    # says so) is alive, not wedged, for up to this long: a long prefill chunk is work, not silence.
    step_timeout: Seconds = 300.0
    # A failed model is tried again after failed_retry_first seconds, then after
    # a backoff that doubles each time it fails again, up to failed_retry_max.
    failed_retry_first: Seconds = 10.0
    failed_retry_max: Seconds = 300.0
    body_timeout: Seconds = 30.0       # seconds a client has to send its whole request body
    # seconds a client has to send its request line and headers (a slow-loris
    # connection is closed after this), and the most HTTP connections open at once
    # (beyond it the oldest one still sending headers is closed, or the new one gets a 503).
    header_timeout: Seconds = 10.0
    max_connections: int = 1024
    # the pages (origins) that may call /v1/* (and /api/*) from a browser:
    # SCHEME://HOST[:PORT], '*' for a wildcard part, ':*' for any port, or '*' for every origin.
    cors_origins: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_CORS_ORIGINS))
    # The time one prefill turn aims at (its chunks of every prompt prefilling together):
    # a running stream waits about this long between two tokens while others prefill, and a
    # command waits about this long for a step boundary (0 = chunks sized by memory only).
    # 0.25 since fair prefill (1.0 before): a short prompt arriving mid-turn waits for the
    # rest of that turn, and scripts/bench_fairness.py measured 1.0 well past 2x its TTFT alone.
    chunk_seconds: Seconds = 0.25
    # How a prefill turn shares that budget: "shortest" (fewest tokens left first) or
    # "round_robin" (equal shares); worker/scheduler.py.
    prefill_order: PrefillOrder = "shortest"
    max_tokens: int = 32768          # the most tokens one request may ask for
    max_subscribers: int = 64        # PUB subscribers at once (ipc and TCP together); more are refused
    max_body: int | str = "1MiB"
    # PUB on TCP for dashboards on other hosts: opt-in, "HOST:PORT" ("" = ipc only).
    pub_tcp: str = ""
    # A ZeroMQ CURVE secret certificate (zmq.auth.create_certificates); required
    # when pub_tcp binds anything but loopback.
    curve_key_file: str = ""
    # Folders whose models are served without a [[models]] entry each
    # (supervisor.discovery); `serve --models-dir` adds to them.
    models_dirs: list[str] = msgspec.field(default_factory=list)
    # SPEC W1: workers kept started with MLX and the engine imported and no model, so a
    # load costs the weights and not a Python start (0 = none); W2: under pressure they go first.
    spare_workers: int = 1
    # The name this host gives itself in the X-Memvisor-Host response header and the
    # routing signals, so a router in front of several hosts can say which one served
    # (or refused) a request ("" = this machine's name).
    host_name: str = ""
    # Images in (docs/vision.md): at most `max_images` a request (0 turns images off), each at most
    # `max_image_bytes` as sent and `max_image_pixels` (width x height). http(s) image URLs are fetched
    # only with `fetch_image_urls`, within `image_fetch_timeout` seconds and `max_image_bytes`.
    max_images: int = 8
    max_image_bytes: int | str = "8MiB"
    max_image_pixels: int = 4096 * 4096
    fetch_image_urls: bool = False
    image_fetch_timeout: Seconds = 10.0

    def __post_init__(self) -> None:
        self._check_images()
        if len(self.host_name) > 64 or not all(c.isalnum() or c in "-_.:" for c in self.host_name):
            raise _FieldError("host_name", "at most 64 letters, digits and - _ . : (it goes in a header)")
        try:
            parse_http(self.http)
        except ValueError as exc:
            raise _FieldError("http", str(exc)) from None
        if self.pub_tcp:
            try:
                host, _port = parse_http(self.pub_tcp)
            except ValueError as exc:
                raise _FieldError("pub_tcp", str(exc)) from None
            if not is_loopback(host) and not self.curve_key_file:
                raise _FieldError(
                    "pub_tcp",
                    f"{host} is not a loopback address: a non-loopback bind requires CURVE keys; "
                    "set supervisor.curve_key_file to a secret certificate "
                    "(python -c \"import zmq.auth; zmq.auth.create_certificates('.', 'memvisor')\")",
                )
        if self.api_keys_file and not Path(self.api_keys_file).expanduser().is_file():
            raise _FieldError("api_keys_file", f"{self.api_keys_file} is not a readable file")
        if any(not k.strip() for k in self.api_keys):
            raise _FieldError("api_keys", "keys must not be empty")
        self.max_body = _size("max_body", self.max_body)
        if self.max_body < 1:
            raise _FieldError("max_body", "must be at least 1 byte")
        _non_negative("idle_timeout", self.idle_timeout)
        for name, low, high in _SUPERVISOR_RANGES:
            _between(name, getattr(self, name), low, high)
        if not 0 <= self.queue_size <= 1_000_000:
            raise _FieldError("queue_size", f"must be 0..1000000, got {self.queue_size}")
        if not 0 <= self.restart_max <= 1000:
            raise _FieldError("restart_max", f"must be 0..1000, got {self.restart_max}")
        if self.chunk_seconds != 0:
            _between("chunk_seconds", self.chunk_seconds, 0.01, 600.0)
        if not 1 <= self.max_subscribers <= 10_000:
            raise _FieldError("max_subscribers", f"must be 1..10000, got {self.max_subscribers}")
        if not 1 <= self.max_connections <= 1_000_000:
            raise _FieldError("max_connections", f"must be 1..1000000, got {self.max_connections}")
        for origin in self.cors_origins:
            problem = check_origin_pattern(origin)
            if problem is not None:
                raise _FieldError("cors_origins", problem)
        if not 0 <= self.spare_workers <= MAX_SPARE_WORKERS:
            raise _FieldError("spare_workers", f"must be 0..{MAX_SPARE_WORKERS}, got {self.spare_workers}")
        if not 1 <= self.max_tokens <= 10_000_000:
            raise _FieldError("max_tokens", f"must be 1..10000000, got {self.max_tokens}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise _FieldError(
                "heartbeat_timeout",
                f"must be longer than heartbeat_interval ({self.heartbeat_interval}), "
                f"got {self.heartbeat_timeout}",
            )


    def _check_images(self) -> None:
        self.max_image_bytes = _size("max_image_bytes", self.max_image_bytes)
        if not 0 <= self.max_images <= 256:
            raise _FieldError("max_images", f"must be 0..256, got {self.max_images}")
        if self.max_image_bytes < 1:
            raise _FieldError("max_image_bytes", "must be at least 1 byte")
        if self.max_images * self.max_image_bytes > MAX_IMAGE_PAYLOAD:
            raise _FieldError("max_image_bytes", f"max_images x max_image_bytes must be at most "
                                                 f"{MAX_IMAGE_PAYLOAD // 2**20} MiB (one request's images travel "
                                                 "to the worker in one frame)")
        if not 1 <= self.max_image_pixels <= 2**31:
            raise _FieldError("max_image_pixels", f"must be 1..{2**31}, got {self.max_image_pixels}")
        _between("image_fetch_timeout", self.image_fetch_timeout, 0.1, 600.0)


MAX_CONCURRENCY = 1024  # requests one worker runs at once; far past what one model batches
MAX_QUEUE = 100_000  # requests that may wait for a model's slots


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One `[[models]]` entry. `ttl` absent = the global idle timeout (P10)."""

    id: str
    path: str
    pinned: bool = False
    ttl: Seconds | None = None
    max_concurrency: int = 4
    # Requests that may wait for one of its max_concurrency slots; one more is a 429
    # with Retry-After (a router sends it to another host), never an unbounded queue.
    max_queue: int = 64
    aliases: list[str] = msgspec.field(default_factory=list)  # other names requests may use
    # Another model's id or alias: a small model of the same vocabulary, loaded in this model's
    # worker, whose guesses this model checks (speculative decoding, worker/draft.py); "" = none
    draft: str = ""

    def __post_init__(self) -> None:
        if not self.id.strip():
            raise _FieldError("id", "must not be empty")
        problem = check_model_id(self.id)
        if problem:
            raise _FieldError("id", problem)
        if not self.path.strip():
            raise _FieldError("path", "must not be empty")
        if self.ttl is not None:
            _non_negative("ttl", self.ttl)
        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY:
            raise _FieldError("max_concurrency", f"must be 1..{MAX_CONCURRENCY}, got {self.max_concurrency}")
        if not 0 <= self.max_queue <= MAX_QUEUE:
            raise _FieldError("max_queue", f"must be 0..{MAX_QUEUE}, got {self.max_queue}")
        for j, alias in enumerate(self.aliases):
            if not alias.strip():
                raise _FieldError(f"aliases[{j}]", "must not be empty")
            if alias == self.id:
                raise _FieldError(f"aliases[{j}]", f"alias {alias!r} repeats the model's own id")
        if self.draft and (self.draft == self.id or self.draft in self.aliases):
            raise _FieldError("draft", f"{self.draft!r} is this model itself: a draft is a smaller model")

    def path_problem(self) -> str | None:
        """Why the model's path cannot be loaded (checked when serving starts,
        not first found by a worker at load time), or None."""
        path = Path(self.path).expanduser()
        if not path.exists():
            return f"{self.path}: no such file or folder"
        if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
            return None
        return f"{self.path}: not a model folder (nor a .gguf file)"


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    guard: GuardConfig = msgspec.field(default_factory=GuardConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    models: list[ModelConfig] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        owner: dict[str, str] = {}  # every id and alias -> what claims it, for the error
        for index, model in enumerate(self.models):
            if model.id in owner:
                raise _FieldError(f"models[{index}].id", f"duplicate model id {model.id!r} "
                                  f"(already {owner[model.id]})")
            owner[model.id] = f"the id of models[{index}]"
        for index, model in enumerate(self.models):
            for j, alias in enumerate(model.aliases):
                if alias in owner:
                    raise _FieldError(f"models[{index}].aliases[{j}]",
                                      f"alias {alias!r} of model {model.id!r} collides with {owner[alias]}")
                owner[alias] = f"an alias of models[{index}] ({model.id!r})"

    def path_problems(self) -> list[str]:
        """`models[i].path: why` for every model whose path cannot be loaded."""
        return [f"models[{i}].path: {why}" for i, m in enumerate(self.models) if (why := m.path_problem())]

    def model(self, name: str) -> ModelConfig | None:
        """The model a request names, by id or by alias."""
        for m in self.models:
            if m.id == name or name in m.aliases:
                return m
        return None

    def names(self) -> set[str]:
        """Every id and alias in use."""
        return {name for m in self.models for name in (m.id, *m.aliases)}


_PATH_RE = re.compile(r"^(?P<reason>.*) - at `\$(?P<path>[^`]*)`$", re.S)
# A `__post_init__` reason starts with "field: " (or "models[1].id: " from Config).
_FIELD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?(\.[A-Za-z_][A-Za-z0-9_]*)?")


def _key_path_message(exc: msgspec.ValidationError) -> str:
    """Turn msgspec's "reason - at `$.guard`" into "guard.key: reason"; an unknown key
    with the known keys it is closest to."""
    text = str(exc)
    match = _PATH_RE.match(text)
    path, reason = (match["path"].lstrip("."), match["reason"]) if match else ("", text)
    field, sep, rest = reason.partition(": ")
    if sep and _FIELD_RE.fullmatch(field):
        path, reason = _join(path, field), rest
    unknown = re.match(r"Object contains unknown field `([^`]+)`", reason)
    if unknown:
        reason = "unknown key" + _did_you_mean(unknown[1], _known_keys(path))
        path = _join(path, unknown[1])
    return f"{path}: {reason}" if path else reason


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def _did_you_mean(key: str, known: list[str]) -> str:
    """"; did you mean pinned?" for a key one typo away from a known one (difflib's ratio)."""
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.7)
    if not close:
        return ""
    return "; did you mean " + " or ".join(close) + "?"


def _struct_at(path: str) -> mi.StructType | None:
    """The table that `path` ("models[0]", "guard", "") names in the config's schema."""
    info: mi.Type = mi.type_info(Config)
    for part in filter(None, re.sub(r"\[\d+\]", "", path).split(".")):
        if not isinstance(info, mi.StructType):
            return None
        field = next((f for f in info.fields if f.encode_name == part), None)
        if field is None:
            return None
        info = field.type
        if isinstance(info, mi.ListType):
            info = info.item_type
    return info if isinstance(info, mi.StructType) else None


def _known_keys(path: str) -> list[str]:
    table = _struct_at(path)
    return [f.encode_name for f in table.fields] if table is not None else []


def _is_duration(info: mi.Type) -> bool:
    if isinstance(info, mi.Metadata):
        return bool((info.extra or {}).get("duration"))
    if isinstance(info, mi.UnionType):
        return any(_is_duration(t) for t in info.types)
    return False


def _read_durations(raw: Any, info: mi.Type, path: str) -> Any:
    """`raw` with every duration written as text ("10m") turned into seconds, walking the
    config's schema; a duration that does not parse is a ConfigError naming its key."""
    if isinstance(info, mi.ListType) and isinstance(raw, list):
        return [_read_durations(item, info.item_type, f"{path}[{i}]") for i, item in enumerate(raw)]
    if not (isinstance(info, mi.StructType) and isinstance(raw, dict)):
        return raw
    out = dict(raw)
    for field in info.fields:
        key = field.encode_name
        if key not in out:
            continue
        if _is_duration(field.type) and isinstance(out[key], str):
            try:
                out[key] = parse_duration(out[key])
            except DurationError as exc:
                raise ConfigError(f"{_join(path, key)}: {exc}") from None
        else:
            out[key] = _read_durations(out[key], field.type, _join(path, key))
    return out


def config_from(raw: Any, source: str = "config") -> Config:
    """A validated `Config` from plain data (a decoded TOML file, or `to_builtins` of one with
    the command line's changes), or ConfigError naming `source` and the key path."""
    try:
        raw = _read_durations(raw, mi.type_info(Config), "")
        return msgspec.convert(raw, type=Config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_key_path_message(exc)}") from None


def parse_config(text: str | bytes, source: str = "config") -> Config:
    """Decode TOML text into a validated `Config`, or raise `ConfigError`."""
    try:
        raw = msgspec.toml.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return config_from(raw, source)


def load_config(path: str | Path) -> Config:
    """Read and validate the TOML file at `path` (errors name file and key)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_config(data, source=str(path))


def host_name(config: Config) -> str:
    """This host's name for the routing signals: `[supervisor] host_name`, else the machine's."""
    return config.supervisor.host_name or socket.gethostname()


def guard_settings(config: Config, *, pressure_reclaim_disabled: bool = False) -> GuardSettings:
    """GuardSettings from a loaded `Config` (the starting point
    the enforcer then changes at runtime, T6)."""
    g = config.guard
    return GuardSettings(
        enabled=g.enabled,
        tier=cast(Tier, g.tier),  # normalised by GuardConfig.__post_init__
        custom_ceiling=int(g.custom_ceiling),  # sizes are int bytes once built
        custom_device_ceiling=int(g.custom_device_ceiling),
        soft_threshold=g.soft_threshold,
        hard_threshold=g.hard_threshold,
        idle_timeout=config.supervisor.idle_timeout,
        hot_cache_max=int(g.hot_cache_max),
        pool_max=int(g.pool_max),
        safe_zone_ratio=g.safe_zone_ratio,
        min_chunk_tokens=g.min_chunk_tokens,
        wire_weights=g.wire_weights,
        poll_interval=g.poll_interval,
        loaded_idle_interval=g.loaded_idle_interval,
        unloaded_idle_interval=g.unloaded_idle_interval,
        pressure_reclaim_disabled=pressure_reclaim_disabled,
        spare_workers=config.supervisor.spare_workers,
    )
