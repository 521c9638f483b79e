"""`rm MODEL`: remove a model `pull` fetched, and its files in the Hugging Face cache.

Only what the pull record names (supervisor.models.pulled) can be removed: a model
of `[[models]]` or `models_dirs` is the user's own folder and stays. A
running supervisor is asked to reload first: the model leaves its catalogue,
and a loaded one is drained and stopped as any removed model is (SPEC P6's
stop, its requests finished or refused). Then the files go, through
huggingface_hub's cache API, unless another pulled model shares the snapshot.
"""

from __future__ import annotations

import argparse
import sys

from shared import protocol as p
from supervisor.cli._control import call
from supervisor.wiring.runtime import runtime_dir_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a pulled model's id (ORG/NAME or ORG/NAME:TAG)")


def run(args: argparse.Namespace) -> int:
    from supervisor.models import pulled
    try:
        models = pulled.read()
        entry = pulled.find(args.model, models)
        if entry is None:
            names = ", ".join(m.id for m in models) or "none"
            print(f"memvisor: {args.model!r} was not pulled (pulled: {names}); rm removes only what pull "
                  "fetched, never a folder of [[models]] or models_dirs", file=sys.stderr)
            return 1
        left = pulled.forget(entry)
    except (pulled.RecordError, OSError) as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 1
    if runtime_dir_problem(args.runtime_dir) is None and (args.runtime_dir / "endpoints.json").exists():
        code, _reply = call(args, p.ReloadRequest(), timeout=120, quiet=True)
        if code == 1:
            print(f"memvisor: the running supervisor did not reload; it serves {entry.id} until it does",
                  file=sys.stderr)
    try:
        print(f"removed {entry.id}: {pulled.delete_files(entry, left)}")
    except OSError as exc:
        print(f"memvisor: {entry.id} is no longer served, but its files stay: {exc}", file=sys.stderr)
        return 1
    return 0
