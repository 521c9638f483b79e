"""Reading a configuration file: TOML in, a validated `Config` out, or a `ConfigError` whose
message starts with the key path (`guard.soft_threshold: ...`) so a person can fix the file
without reading a traceback.

Apart from supervisor/config.py (the tables and their fields) because this is the reader's
work on msgspec's answers, not a part of any table: msgspec's "reason - at `$.guard`" turned
into "guard.key: reason", an unknown key named with the key it may have meant (`models[0].pinnned:
unknown key; did you mean pinned?`), and every duration written as text ("10m", `Seconds`
in supervisor/config_checks.py) turned into seconds before msgspec checks the types.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from shared.durations import DurationError, parse_duration
from supervisor.config import Config


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key path."""

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
