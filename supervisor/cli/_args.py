"""Argument types shared by the commands."""

from __future__ import annotations

import argparse

from shared.sizes import SizeError, parse_size


def size_arg(text: str) -> int:
    """argparse type for a SIZE flag: argparse prints the parser's own reason."""
    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
