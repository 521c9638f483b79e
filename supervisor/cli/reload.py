"""`reload`: re-read the running supervisor's config and rescan its models folders.

The same as sending it SIGHUP, but with an answer: what changed, or why the
new config was refused (the running one then stays in force)."""

from __future__ import annotations

import argparse

from shared import protocol as p
from supervisor.cli._control import call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    return call(args, p.ReloadRequest())[0]
