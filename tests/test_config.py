"""The TOML configuration (docs/configuration.md; T5 thresholds).

Bad values must come back as one line naming the key path and the reason,
never a traceback."""

from __future__ import annotations

import pytest

from shared.sizes import GiB, MiB
from supervisor.config import Config, SupervisorConfig, guard_settings
from supervisor.config_checks import parse_http
from supervisor.config_file import ConfigError, load_config, parse_config
from supervisor.policy.tiers import resolve_thresholds

FULL = """
[guard]
enabled = true
tier = "Aggressive"
custom_ceiling = "12GiB"
soft_threshold = 0.9
hard_threshold = 0.97
budget = "1536MiB"
hot_cache_max = 2000000000
safe_zone_ratio = 0.8
min_chunk_tokens = 128
poll_interval = 0.5
loaded_idle_interval = 5
unloaded_idle_interval = 20
wire_weights = true

[supervisor]
http = "0.0.0.0:9000"
idle_timeout = 600
allow_drills = true
admin_token = "s3cret"
queue_size = 8
queue_deadline = 30.0
restart_max = 5
restart_period = 120
stop_grace = 3
heartbeat_interval = 0.5
heartbeat_timeout = 2
max_body = "2GB"

[[models]]
id = "small"
path = "/models/small"
pinned = true

[[models]]
id = "big"
path = "/models/big"
ttl = 300
max_concurrency = 2
"""


def test_config_defaults_are_the_builtin_demo():
    c = Config()
    assert c.guard.tier == "balanced" and c.guard.enabled
    assert c.guard.soft_threshold is None and c.guard.hard_threshold is None
    assert c.guard.safe_zone_ratio == 0.89 and c.guard.min_chunk_tokens == 256
    assert (c.guard.poll_interval, c.guard.loaded_idle_interval, c.guard.unloaded_idle_interval) == (1.0, 10.0, 30.0)
    assert c.supervisor.http == "127.0.0.1:8000"
    assert c.supervisor.max_body == MiB
    assert c.models == []
    assert not c.guard.wire_weights and not guard_settings(c).wire_weights  # M2 (2026-12-05): no wiring


def test_config_full_file_round_trip(tmp_path):
    path = tmp_path / "memvisor.toml"
    path.write_text(FULL)
    c = load_config(path)
    assert c.guard.custom_ceiling == 12 * GiB
    assert c.guard.budget == 1536 * MiB
    assert c.guard.hot_cache_max == 2_000_000_000
    assert c.supervisor.max_body == 2 * 10**9
    assert c.supervisor.idle_timeout == 600.0
    assert [m.id for m in c.models] == ["small", "big"]
    assert c.models[0].pinned and c.models[0].ttl is None and c.models[0].max_concurrency == 4
    assert c.model("big").ttl == 300 and c.model("big").max_concurrency == 2
    settings = guard_settings(c)
    assert settings.custom_ceiling == 12 * GiB and settings.idle_timeout == 600.0
    assert settings.tier == "aggressive"  # T2: normalised where it enters, the guard reads a Tier
    assert settings.wire_weights  # M2: the opt-in reaches the policy, which hands out the residency


@pytest.mark.parametrize(
    "toml, fragment",
    [
        ('[guard]\nsoft_treshold = 0.9', "guard.soft_treshold: unknown key; did you mean soft_threshold?"),
        ('[gaurd]\ntier = "safe"', "gaurd: unknown key; did you mean guard?"),
        ('[guard]\nbudget = "12 parsecs"', "guard.budget: unknown unit"),
        ('[guard]\nbudget = -5', "guard.budget: size must not be negative"),
        ('[guard]\nhot_cache_max = "1.5"', "guard.hot_cache_max: a byte count must be whole"),
        ('[guard]\npoll_interval = "fast"', "guard.poll_interval: 'fast' is not a duration"),
        ('[guard]\npoll_interval = 0', "guard.poll_interval: must be between 0.01 and 3600 seconds"),
        ('[guard]\nloaded_idle_interval = -1', "guard.loaded_idle_interval: must be between"),
        ('[guard]\nenabled = "yes"', "guard.enabled: Expected `bool`"),
        ('[guard]\nwire_weights = 1', "guard.wire_weights: Expected `bool`"),
        ('[guard]\nsafe_zone_ratio = 1.5', "guard.safe_zone_ratio: must be in (0, 1]"),
        ('[guard]\nmin_chunk_tokens = 0', "guard.min_chunk_tokens: must be 1..1000000"),
        ('[supervisor]\nhttp = "localhost"', "supervisor.http: expected HOST:PORT"),
        ('[supervisor]\nhttp = "127.0.0.1:99999"', "supervisor.http: port must be 1-65535"),
        ('[supervisor]\nidle_timeout = -1', "supervisor.idle_timeout: must be zero or a positive"),
        ('[supervisor]\nmax_body = 0', "supervisor.max_body: must be at least 1 byte"),
        ('[supervisor]\nheartbeat_timeout = 0.5', "supervisor.heartbeat_timeout: must be longer"),
        ('[[models]]\nid = "a"\npath = "/a"\n[[models]]\nid = ""\npath = "/b"', "models[1].id: must not be empty"),
        ('[[models]]\nid = "a"\npath = "/a"\nmax_concurrency = 0', "models[0].max_concurrency: must be 1..1024"),
        ('[[models]]\nid = "a"\npath = "/a"\nttl = -3', "models[0].ttl: must be zero or a positive"),
        ('[[models]]\nid = "a"', "models[0]: Object missing required field `path`"),
        ('[[models]]\nid = "a"\npath = "/a"\n[[models]]\nid = "a"\npath = "/b"', "models[1].id: duplicate model id 'a'"),
        ('guard = 3', "guard: Expected `object`, got `int`"),
        ('[guard\n', "not valid TOML"),
    ],
)
def test_config_errors_name_the_key_path_and_reason(toml, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(toml, source="my.toml")
    message = str(info.value)
    assert message.startswith("my.toml: ")
    assert fragment in message, message


@pytest.mark.parametrize(
    "toml, fragment",
    [
        ('[guard]\nsoft_threshold = 0.96', "guard.soft_threshold: soft 0.96 must be below hard 0.95"),
        ('[guard]\nsoft_threshold = 1.2\nhard_threshold = 1.3', "guard.soft_threshold: must be at most 1"),
        ('[guard]\nhard_threshold = 1.5', "guard.hard_threshold: must be at most 1"),
        ('[guard]\nsoft_threshold = 0.9\nhard_threshold = 0.9', "guard.soft_threshold: soft 0.9 must be below hard 0.9"),
        ('[guard]\nsoft_threshold = nan', "guard.soft_threshold: must be a number"),
    ],
)
def test_t5_bad_thresholds_are_config_errors(toml, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        parse_config(toml)
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "toml, tier, in_force",
    [
        ('[guard]\nsoft_threshold = 0.85\nhard_threshold = 0.95', "balanced", (0.90, 0.95)),  # legacy: tier defaults
        ('[guard]\ntier = "aggressive"\nsoft_threshold = 0.96', "aggressive", (0.96, 0.98)),  # below its 0.98
        ('[guard]\nsoft_threshold = 0\nhard_threshold = 0', "balanced", (0.90, 0.95)),  # 0: tier defaults
        ('[guard]\nsoft_threshold = 0.8\nhard_threshold = 0.9', "balanced", (0.80, 0.90)),  # explicit wins
        ('[guard]\ntier = " Safe "', "safe", (0.85, 0.95)),  # T2: normalised
    ],
)
def test_t5_accepted_thresholds_are_the_ones_in_force(toml, tier, in_force):
    """An accepted config guards with the thresholds T5 puts in force, not merely parses."""
    guard = guard_settings(parse_config(toml))
    assert guard.tier == tier
    assert resolve_thresholds(guard.tier, guard.soft_threshold, guard.hard_threshold) == in_force


def test_config_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    "text, expected",
    [("127.0.0.1:8000", ("127.0.0.1", 8000)), ("[::1]:80", ("::1", 80)), ("localhost:1", ("localhost", 1))],
)
def test_parse_http(text, expected):
    assert parse_http(text) == expected


def test_pub_tcp_is_opt_in_and_a_non_loopback_bind_requires_curve_keys():
    """docs/architecture.md: TCP binds loopback unless told otherwise; beyond it, CURVE keys."""
    assert SupervisorConfig().pub_tcp == ""
    assert SupervisorConfig(pub_tcp="127.0.0.1:5556").pub_tcp == "127.0.0.1:5556"
    assert SupervisorConfig(pub_tcp="[::1]:5556").pub_tcp == "[::1]:5556"
    with pytest.raises(ConfigError, match=r"supervisor\.pub_tcp: 0\.0\.0\.0 is not a loopback address.*CURVE"):
        parse_config('[supervisor]\npub_tcp = "0.0.0.0:5556"\n')
    ok = parse_config('[supervisor]\npub_tcp = "0.0.0.0:5556"\ncurve_key_file = "/etc/memvisor/server.key_secret"\n')
    assert ok.supervisor.curve_key_file.endswith("key_secret")
    with pytest.raises(ConfigError, match=r"supervisor\.pub_tcp: expected HOST:PORT"):
        parse_config('[supervisor]\npub_tcp = "nowhere"\n')


# Configs that parsed but broke the system at run time are refused
# at load, with the key path. Each of these was accepted before.
@pytest.mark.parametrize(
    "toml, fragment",
    [
        ('[[models]]\nid = "a"\npath = "/a"\nmax_concurrency = 99999999999999999999',
         "models[0].max_concurrency"),
        ('[[models]]\nid = "a"\npath = "/a"\nmax_concurrency = 100000', "models[0].max_concurrency: must be 1..1024"),
        ('[supervisor]\nheartbeat_interval = 1e-9', "supervisor.heartbeat_interval: must be between 0.05"),
        ('[guard]\npoll_interval = 1e-9', "guard.poll_interval: must be between 0.01"),
        ('[guard]\ntier = "turbo"', "guard.tier: unknown tier 'turbo'"),
        ('[guard]\nsoft_threshold = -0.5', "guard.soft_threshold: must not be negative"),
        ('[guard]\nhard_threshold = -1', "guard.hard_threshold: must not be negative"),
        ('[[models]]\nid = "a/load"\npath = "/a"', "models[0].id: 'a/load' ends in a route word"),
        ('[[models]]\nid = "a/unload"\npath = "/a"', "models[0].id: 'a/unload' ends in a route word"),
        ('[[models]]\nid = "a b"\npath = "/a"', "models[0].id: 'a b' is not a usable model id"),
        ('[[models]]\nid = "a/../b"\npath = "/a"', "models[0].id: 'a/../b' is not a usable model id"),
        ('[[models]]\nid = "/abs"\npath = "/a"', "models[0].id: '/abs' is not a usable model id"),
        ('[supervisor]\nqueue_size = 99999999999', "supervisor.queue_size: must be 0..1000000"),
        ('[supervisor]\nmax_tokens = 0', "supervisor.max_tokens: must be 1..10000000"),
        ('[supervisor]\nbody_timeout = 0', "supervisor.body_timeout: must be between"),
        ('[supervisor]\nstep_timeout = inf', "supervisor.step_timeout: must be between"),
    ],
)
def test_runtime_breaking_values_are_refused_with_the_key_path(toml, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(toml, source="my.toml")
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("model_id", ["qwen", "mlx-community/Qwen2.5-0.5B-Instruct-4bit", "a:b@c+d", "loader"])
def test_model_ids_the_routes_carry_are_accepted(model_id):
    parse_config(f'[[models]]\nid = "{model_id}"\npath = "/a"')


def test_model_paths_are_checked_at_start(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"x")
    config = parse_config(f'[[models]]\nid = "ok"\npath = "{folder}"\n'
                          f'[[models]]\nid = "gone"\npath = "{tmp_path / "absent"}"\n'
                          f'[[models]]\nid = "file"\npath = "{afile}"')
    problems = config.path_problems()
    assert problems == [f"models[1].path: {tmp_path / 'absent'}: no such file or folder",
                        f"models[2].path: {afile}: not a model folder (nor a .gguf file)"]


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[[models]]\nid = "a"\npath = "/a"\npinnned = true', "models[0].pinnned: unknown key; did you mean pinned?"),
        ('[supervisor]\nidle_timout = 5', "supervisor.idle_timout: unknown key; did you mean idle_timeout?"),
        ('[guard]\nteir = "safe"', "guard.teir: unknown key; did you mean tier?"),
        ('[[model]]\nid = "a"', "model: unknown key; did you mean models?"),
        ('[guard]\nzzz = 1', "guard.zzz: unknown key"),
    ],
)
def test_an_unknown_key_keeps_its_key_path_and_says_which_known_key_it_may_mean(toml, message):
    with pytest.raises(ConfigError) as info:
        parse_config(toml, source="my.toml")
    assert str(info.value) == f"my.toml: {message}"


def _duration_fields() -> list[tuple[str, str]]:
    """(table, key) of every field typed `Seconds`, read from the schema, so a new one is covered."""
    import msgspec.inspect as mi

    from supervisor.config import Config

    out = []
    for table in mi.type_info(Config).fields:
        info = table.type.item_type if isinstance(table.type, mi.ListType) else table.type
        for field in info.fields:
            types = field.type.types if isinstance(field.type, mi.UnionType) else (field.type,)
            if any(isinstance(t, mi.Metadata) and (t.extra or {}).get("duration") for t in types):
                out.append((table.encode_name, field.encode_name))
    return out


def test_every_config_value_in_seconds_takes_a_duration_with_units():
    """keep_alive took "10m" while the config refused it: every duration in the file takes the
    same grammar (shared.durations), a bare number still being seconds."""
    import msgspec.inspect as mi

    from supervisor.config import Config

    fields = _duration_fields()
    timelike = ("timeout", "ttl", "deadline", "grace", "period", "interval", "retry", "seconds", "window", "hold")
    for table in mi.type_info(Config).fields:  # nothing that reads as a time is left a bare float
        info = table.type.item_type if isinstance(table.type, mi.ListType) else table.type
        for field in info.fields:
            if set(field.encode_name.split("_")) & set(timelike):
                assert (table.encode_name, field.encode_name) in fields, field.encode_name
    assert {"idle_timeout", "ttl", "queue_deadline", "heartbeat_timeout", "step_timeout", "body_timeout",
            "header_timeout", "restart_period", "failed_retry_first", "disk_cache_grace", "stop_grace"} <= {
        key for _, key in fields}
    for table, key in fields:
        head = "[[models]]\nid = \"a\"\npath = \"/a\"\n" if table == "models" else f"[{table}]\n"
        config = parse_config(f'{head}{key} = "1.5s"')
        section = config.models[0] if table == "models" else getattr(config, table)
        assert getattr(section, key) == 1.5, key


@pytest.mark.parametrize("text, seconds", [('"10m"', 600.0), ('"90s"', 90.0), ('"1h30m"', 5400.0), ("90", 90.0),
                                           ('"250ms"', 0.25), ('"120"', 120.0), ("2.5", 2.5)])
def test_a_duration_is_a_number_of_seconds_or_go_units(text, seconds):
    assert parse_config(f"[supervisor]\nidle_timeout = {text}").supervisor.idle_timeout == seconds


@pytest.mark.parametrize("text, fragment", [
    ('"10 minutes"', "supervisor.idle_timeout: '10 minutes' is not a duration"),
    ('"inf"', "supervisor.idle_timeout: 'inf' is not a duration"),
    ('"-5m"', "supervisor.idle_timeout: must be zero or a positive number of seconds"),
    ('"2d"', "supervisor.idle_timeout: '2d' is not a duration"),
    ("true", "supervisor.idle_timeout: Expected `float`, got `bool`"),
])
def test_a_duration_that_cannot_be_read_names_its_key(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(f"[supervisor]\nidle_timeout = {text}", source="my.toml")
    assert fragment in str(info.value)


def test_keep_alive_and_the_config_read_durations_with_one_grammar():
    from shared.durations import parse_duration
    from supervisor.http.keepalive import keep_alive_seconds

    for text in ("10m", "1h30m", "90s", "250ms", "1.5h"):
        assert keep_alive_seconds(text, None) == parse_duration(text) == parse_config(
            f'[supervisor]\nidle_timeout = "{text}"').supervisor.idle_timeout


def test_cli_seconds_flags_take_durations():
    from supervisor.cli import build_parser

    assert build_parser("watch").parse_args(["watch", "--timeout", "2m"]).timeout == 120.0
    assert build_parser("status").parse_args(["status", "--timeout", "1m30s"]).timeout == 90.0
    with pytest.raises(SystemExit):
        build_parser("status").parse_args(["status", "--timeout", "soon"])
