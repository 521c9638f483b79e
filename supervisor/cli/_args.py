"""Argument types shared by the commands."""

from __future__ import annotations

import argparse

from shared.durations import DurationError, parse_duration
from shared.sizes import SizeError, parse_size


def context_arg(text: str) -> int:
    """argparse type for a count of context tokens: 0 .. MAX_CONTEXT_TOKENS (one
    over 2**64 could not be sent and printed a traceback)."""
    from supervisor.wiring.control_answers import MAX_CONTEXT_TOKENS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if not 0 <= value <= MAX_CONTEXT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_CONTEXT_TOKENS} tokens, got {value}")
    return value


def size_arg(text: str) -> int:
    """argparse type for a SIZE flag: argparse prints the parser's own reason."""
    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration_arg(text: str) -> float:
    """argparse type for a flag that takes seconds: `30`, `90s`, `10m`, `1h30m` (the config's
    and keep_alive's grammar, shared.durations); more than zero."""
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return seconds
