"""`load MODEL`: load through the running supervisor, under the same admission rules as HTTP (SPEC A).

`--dry-run` answers "will it fit?" without spawning or stopping anything."""

from __future__ import annotations

import argparse

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from supervisor.cli._args import context_arg
from supervisor.cli._control import call
from supervisor.policy.admission import FitReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model id (or alias) from the config")
    parser.add_argument("--dry-run", action="store_true", help="say whether it fits; load nothing")
    parser.add_argument("--context", type=context_arg, default=0, metavar="TOKENS",
                        help="with --dry-run: count the KV cache of this many tokens too")
    parser.add_argument("--json", action="store_true", help="with --dry-run: the answer as JSON")


def run(args: argparse.Namespace) -> int:
    request = p.LoadRequest(model=args.model, dry_run=args.dry_run, context=args.context)
    if not args.dry_run:
        return call(args, request)[0]
    code, reply = call(args, request, quiet=True)
    if code != 0 or not isinstance(reply, p.ControlOk):
        return code
    report = msgspec.json.decode(reply.data, type=FitReport)
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(describe(report))
    return 0 if report.fits else 1


def describe(r: FitReport) -> str:
    need = format_size(r.estimated_bytes)
    parts = f"weights {format_size(r.weight_bytes)}"
    if r.context_tokens:
        parts += f" + KV for {r.context_tokens} tokens {format_size(r.kv_bytes)}"
    lines = [
        f"{r.model}: {'fits' if r.fits else 'does NOT fit'} ({need}: {parts})",
        f"  {'device ' if r.pool == 'device' else ''}usage now {format_size(r.usage)}; "
        f"{'device ' if r.pool == 'device' else ''}ceiling {format_size(r.ceiling)} (binding: {r.binding or 'none'})",
    ]
    if r.evict:
        lines.append(f"  would stop first: {', '.join(r.evict)}")
    lines.append(f"  {r.message}")
    return "\n".join(lines)
