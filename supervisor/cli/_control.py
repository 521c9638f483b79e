"""Shared by the commands that send one request over the control socket."""

from __future__ import annotations

import sys

from shared import protocol as p
from supervisor.client import ControlClient, NotRunning


def call(args, request: p.Msg, timeout: float = 600.0, quiet: bool = False):
    """Send `request`; print the outcome (errors only when `quiet`). Returns (exit code, reply or None)."""
    try:
        with ControlClient(args.runtime_dir) as client:
            reply = client.call(request, timeout=timeout)
    except NotRunning as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 3, None
    if isinstance(reply, p.ControlError):
        print(f"memvisor: {reply.message} ({reply.code})", file=sys.stderr)
        return 1, reply
    if reply.detail and not quiet:
        print(reply.detail)
    return 0, reply
