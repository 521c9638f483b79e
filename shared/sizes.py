"""Byte sizes as people write them: `1536MiB`, `1.5GiB`, `2GB`, `4096`.

One parser for config, CLI flags and HTTP bodies, so a size means the same
thing everywhere. Decimal units are powers of 1000 and binary units powers of
1024, as their names say; a bare number is bytes.
"""

from __future__ import annotations

import math
import re

GiB = 1024**3
MiB = 1024**2

# The ledger and every wire message carry sizes as 64-bit integers; a larger
# one (a custom ceiling of "99999999999TiB") could be stored but not sent, and
# the first tick that published it raised inside the supervisor's loop.
MAX_SIZE = 2**63 - 1

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """A size that cannot be read; the message says what was wrong."""


def parse_size(text: str | int | float) -> int:
    """Return the number of bytes `text` names (truncated to a whole byte).

    Accepts ints (bytes) too, so a TOML integer and a TOML string go through
    the same door. Negative, non-finite and unit-less fractional byte counts
    are errors rather than guesses.
    """
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(f"size must not be negative: {text}")
        return _bounded(text, text)
    if isinstance(text, float):
        if not math.isfinite(text) or text < 0 or not text.is_integer():
            raise SizeError(f"not a whole, non-negative number of bytes: {text!r}")
        return _bounded(int(text), text)
    if not isinstance(text, str):
        raise SizeError(f"not a size: {text!r}")
    match = _SIZE_RE.match(text)
    if match is None:
        raise SizeError(
            f"not a size: {text!r} (write bytes, or a number with a unit such as "
            "1536MiB, 1.5GiB, 2GB)"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise SizeError(
            f"unknown unit {unit!r} in {text!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
        )
    if factor == 1 and "." in number and float(number) != int(float(number)):
        raise SizeError(f"a byte count must be whole: {text!r}")
    if "." not in number:  # whole numbers stay exact (float loses bytes above 2**53)
        return _bounded(int(number) * factor, text)
    return _bounded(int(float(number) * factor), text)


def _bounded(nbytes: int, text: object) -> int:
    if nbytes > MAX_SIZE:
        raise SizeError(f"size {text!r} is too large (at most {MAX_SIZE} bytes, 8 EiB)")
    return nbytes


def format_size(nbytes: int) -> str:
    """Short binary-unit form for people: `1.5 GiB`, `512 MiB`, `900 B`."""
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    for unit, factor in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= factor:
            value = n / factor
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
    return f"{sign}{n} B"
