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

Where the rest lives: the value checks the fields call (sizes, ranges, model ids,
HOST:PORT, origins) in supervisor/config_checks.py; reading a file into a `Config`
(`load_config`, `parse_config`, `config_from`, `ConfigError`) in supervisor/config_file.py.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import cast

import msgspec

from shared.protocol import DISK_CACHE_AUTO, MAX_IMAGE_PAYLOAD
from shared.vocab import PrefillOrder, Tier
from supervisor.config_checks import (
    DEFAULT_CORS_ORIGINS,
    FieldError,
    Seconds,
    between,
    check_model_id,
    check_origin_pattern,
    checked_size,
    is_loopback,
    non_negative,
    parse_http,
)
from supervisor.policy.snapshot import GuardSettings
from supervisor.policy.tiers import ThresholdError, check_thresholds, normalise_tier

__all__ = [
    "Config",
    "GuardConfig",
    "ModelConfig",
    "SupervisorConfig",
    "guard_settings",
    "host_name",
]


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
        self.custom_ceiling = checked_size("custom_ceiling", self.custom_ceiling)
        self.custom_device_ceiling = checked_size("custom_device_ceiling", self.custom_device_ceiling)
        if 0 < self.custom_device_ceiling < MIN_DEVICE_CEILING:
            raise FieldError("custom_device_ceiling", f"must be 0 (unset) or at least 1MiB, got "
                              f"{self.custom_device_ceiling} bytes (a bare number is bytes: write e.g. \"20GiB\")")
        self.budget = checked_size("budget", self.budget)
        self.hot_cache_max = checked_size("hot_cache_max", self.hot_cache_max)
        self.pool_max = checked_size("pool_max", self.pool_max)
        if isinstance(self.disk_cache_max, str) and self.disk_cache_max.strip().lower() == "auto":
            self.disk_cache_max = DISK_CACHE_AUTO
        elif self.disk_cache_max != DISK_CACHE_AUTO:  # -1: a config built before ("auto"), checked again
            self.disk_cache_max = checked_size("disk_cache_max", self.disk_cache_max)
        between("disk_cache_grace", self.disk_cache_grace, 0.0, 60.0)
        if self.cache_quantize_bits not in (0, 4, 8):
            raise FieldError("cache_quantize_bits", f"must be 0 (off), 4 or 8, got {self.cache_quantize_bits}")
        tier, known = normalise_tier(self.tier)
        if not known:
            raise FieldError("tier", f"unknown tier {self.tier!r}: choose safe, balanced, aggressive or custom")
        self.tier = tier  # T2, once, where the name enters: the guard reads a Tier
        for name in ("soft_threshold", "hard_threshold"):
            value = getattr(self, name)
            if value is not None and math.isfinite(value) and value < 0:
                raise FieldError(name, f"must not be negative, got {value!r} (leave it out or 0 for the "
                                        "tier default)")
        try:
            check_thresholds(tier, self.soft_threshold, self.hard_threshold)
        except ThresholdError as exc:
            raise FieldError(exc.key, exc.reason) from None
        if not (math.isfinite(self.safe_zone_ratio) and 0 < self.safe_zone_ratio <= 1):
            raise FieldError("safe_zone_ratio", f"must be in (0, 1], got {self.safe_zone_ratio!r}")
        if not 1 <= self.min_chunk_tokens <= 1_000_000:
            raise FieldError("min_chunk_tokens", f"must be 1..1000000, got {self.min_chunk_tokens}")
        for name in ("poll_interval", "loaded_idle_interval", "unloaded_idle_interval"):
            between(name, getattr(self, name), 0.01, 3600.0)
        between("thrash_swaps", self.thrash_swaps, 1, 1000, "swaps")
        between("thrash_window", self.thrash_window, 1.0, 86400.0)
        between("thrash_hold", self.thrash_hold, 0.0, 60.0)


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
    # (supervisor.models.discovery); `serve --models-dir` adds to them.
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
            raise FieldError("host_name", "at most 64 letters, digits and - _ . : (it goes in a header)")
        try:
            parse_http(self.http)
        except ValueError as exc:
            raise FieldError("http", str(exc)) from None
        if self.pub_tcp:
            try:
                host, _port = parse_http(self.pub_tcp)
            except ValueError as exc:
                raise FieldError("pub_tcp", str(exc)) from None
            if not is_loopback(host) and not self.curve_key_file:
                raise FieldError(
                    "pub_tcp",
                    f"{host} is not a loopback address: a non-loopback bind requires CURVE keys; "
                    "set supervisor.curve_key_file to a secret certificate "
                    "(python -c \"import zmq.auth; zmq.auth.create_certificates('.', 'memvisor')\")",
                )
        if self.api_keys_file and not Path(self.api_keys_file).expanduser().is_file():
            raise FieldError("api_keys_file", f"{self.api_keys_file} is not a readable file")
        if any(not k.strip() for k in self.api_keys):
            raise FieldError("api_keys", "keys must not be empty")
        self.max_body = checked_size("max_body", self.max_body)
        if self.max_body < 1:
            raise FieldError("max_body", "must be at least 1 byte")
        non_negative("idle_timeout", self.idle_timeout)
        for name, low, high in _SUPERVISOR_RANGES:
            between(name, getattr(self, name), low, high)
        if not 0 <= self.queue_size <= 1_000_000:
            raise FieldError("queue_size", f"must be 0..1000000, got {self.queue_size}")
        if not 0 <= self.restart_max <= 1000:
            raise FieldError("restart_max", f"must be 0..1000, got {self.restart_max}")
        if self.chunk_seconds != 0:
            between("chunk_seconds", self.chunk_seconds, 0.01, 600.0)
        if not 1 <= self.max_subscribers <= 10_000:
            raise FieldError("max_subscribers", f"must be 1..10000, got {self.max_subscribers}")
        if not 1 <= self.max_connections <= 1_000_000:
            raise FieldError("max_connections", f"must be 1..1000000, got {self.max_connections}")
        for origin in self.cors_origins:
            problem = check_origin_pattern(origin)
            if problem is not None:
                raise FieldError("cors_origins", problem)
        if not 0 <= self.spare_workers <= MAX_SPARE_WORKERS:
            raise FieldError("spare_workers", f"must be 0..{MAX_SPARE_WORKERS}, got {self.spare_workers}")
        if not 1 <= self.max_tokens <= 10_000_000:
            raise FieldError("max_tokens", f"must be 1..10000000, got {self.max_tokens}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise FieldError(
                "heartbeat_timeout",
                f"must be longer than heartbeat_interval ({self.heartbeat_interval}), "
                f"got {self.heartbeat_timeout}",
            )


    def _check_images(self) -> None:
        self.max_image_bytes = checked_size("max_image_bytes", self.max_image_bytes)
        if not 0 <= self.max_images <= 256:
            raise FieldError("max_images", f"must be 0..256, got {self.max_images}")
        if self.max_image_bytes < 1:
            raise FieldError("max_image_bytes", "must be at least 1 byte")
        if self.max_images * self.max_image_bytes > MAX_IMAGE_PAYLOAD:
            raise FieldError("max_image_bytes", f"max_images x max_image_bytes must be at most "
                                                 f"{MAX_IMAGE_PAYLOAD // 2**20} MiB (one request's images travel "
                                                 "to the worker in one frame)")
        if not 1 <= self.max_image_pixels <= 2**31:
            raise FieldError("max_image_pixels", f"must be 1..{2**31}, got {self.max_image_pixels}")
        between("image_fetch_timeout", self.image_fetch_timeout, 0.1, 600.0)


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
            raise FieldError("id", "must not be empty")
        problem = check_model_id(self.id)
        if problem:
            raise FieldError("id", problem)
        if not self.path.strip():
            raise FieldError("path", "must not be empty")
        if self.ttl is not None:
            non_negative("ttl", self.ttl)
        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY:
            raise FieldError("max_concurrency", f"must be 1..{MAX_CONCURRENCY}, got {self.max_concurrency}")
        if not 0 <= self.max_queue <= MAX_QUEUE:
            raise FieldError("max_queue", f"must be 0..{MAX_QUEUE}, got {self.max_queue}")
        for j, alias in enumerate(self.aliases):
            if not alias.strip():
                raise FieldError(f"aliases[{j}]", "must not be empty")
            if alias == self.id:
                raise FieldError(f"aliases[{j}]", f"alias {alias!r} repeats the model's own id")
        if self.draft and (self.draft == self.id or self.draft in self.aliases):
            raise FieldError("draft", f"{self.draft!r} is this model itself: a draft is a smaller model")

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
                raise FieldError(f"models[{index}].id", f"duplicate model id {model.id!r} "
                                  f"(already {owner[model.id]})")
            owner[model.id] = f"the id of models[{index}]"
        for index, model in enumerate(self.models):
            for j, alias in enumerate(model.aliases):
                if alias in owner:
                    raise FieldError(f"models[{index}].aliases[{j}]",
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
