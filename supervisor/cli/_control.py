"""Shared by the commands that send one request over the control socket."""

from __future__ import annotations

import sys

from shared import protocol as p
from supervisor.wiring.client import ControlClient, NotRunning
from supervisor.wiring.runtime import runtime_dir_problem


def connect(runtime_dir, timeout: float = 10.0) -> ControlClient:
    """A client of the supervisor in `runtime_dir`; NotRunning, with a sentence, when
    there is none or the folder cannot hold one (never an OSError traceback)."""
    problem = runtime_dir_problem(runtime_dir)
    if problem is not None:
        raise NotRunning(problem)
    try:
        return ControlClient(runtime_dir, timeout=timeout)
    except OSError as exc:
        raise NotRunning(f"cannot read the runtime dir {runtime_dir}: {exc.strerror or exc}") from None


def call(args, request: p.Msg, timeout: float = 600.0, quiet: bool = False):
    """Send `request`; print the outcome (errors only when `quiet`). Returns (exit code, reply or None)."""
    try:
        with connect(args.runtime_dir) as client:
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
