"""Durations as people write them: `90`, `2.5`, `"90s"`, `"10m"`, `"1h30m"`, `"250ms"`.

One grammar for the config file, the command line's seconds flags and
Ollama's `keep_alive`, so a duration means the same thing everywhere. It is
Go's (`time.ParseDuration`, which Ollama's clients write): a decimal number
and a unit, repeated (`ns us µs ms s m h`), with an optional sign; a bare
number, or a number in a string, is seconds. Decimal numbers only: `"inf"`,
`"nan"`, `"1e999"` and `"0x10"` are refused rather than read by float(), so a
duration is always finite.

Callers bound the value (the config's ranges, keep_alive's ten years) and say
which key it was; this module only reads.
"""

from __future__ import annotations

import math
import re

UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_UNIT = "(?:ns|us|µs|ms|s|m|h)"
_DURATION = re.compile(rf"([+-]?)((?:(?:\d+(?:\.\d*)?|\.\d+){_UNIT})+)")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
EXAMPLES = '90, "90s", "10m", "1h30m"'


class DurationError(ValueError):
    """A duration that cannot be read; the message says what was given and what is taken."""


def parse_duration(value: str | int | float) -> float:
    """Seconds that `value` names (signed: the caller decides whether a negative means anything)."""
    if isinstance(value, bool):
        raise DurationError(f"not a duration: {value!r} (write seconds or e.g. {EXAMPLES})")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _text(value)
    else:
        raise DurationError(f"not a duration: {value!r} (write seconds or e.g. {EXAMPLES})")
    if not math.isfinite(seconds):
        raise DurationError(f"not a finite duration: {value!r}")
    return seconds


def _text(text: str) -> float:
    stripped = text.strip()
    if _NUMBER.fullmatch(stripped):
        return float(stripped)
    match = _DURATION.fullmatch(stripped)
    if match is None:
        raise DurationError(f"{text!r} is not a duration: write seconds or a number with a unit "
                            f"(ns, us, ms, s, m, h), e.g. {EXAMPLES}")
    total = sum(float(amount) * UNITS[unit] for amount, unit in _PART.findall(match[2]))
    return -total if match[1] == "-" else total

