"""`python -m supervisor replay TRACE.jsonl`: the policy's decisions for a recorded trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from supervisor.policy.replay import BadLine, replay_lines

HELP = """\
Each line of TRACE is one policy Snapshot as JSON (`python -m supervisor schema`
documents it); `-` reads standard input. One JSON line per tick is printed:
{"line", "now", "level", "usage", "projected_usage", "ceiling", "emergency",
"next_interval", "decisions"}.

State: by default the run is chained like the live enforcer: the first line's
`state` starts it and each tick's new state feeds the next line (later lines'
recorded `state` is ignored). With --recorded-state every line is ticked with
its own recorded `state`.

A line that is not a valid snapshot is reported on stderr with its line number
and skipped; the rest still replays, and the exit status is then 1.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (parser.description or "") + "\n\n" + HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("trace", metavar="TRACE.jsonl", help="the trace to replay ('-' = stdin)")
    parser.add_argument(
        "--recorded-state", action="store_true",
        help="tick each line with its own recorded state instead of chaining",
    )
    parser.add_argument(
        "--plot", metavar="OUT.png", type=Path, default=None,
        help="also draw the trace like a lab run: ceiling, watermarks, usage per worker, level, decisions",
    )


def run(args: argparse.Namespace) -> int:
    try:
        stream = sys.stdin.buffer if args.trace == "-" else open(args.trace, "rb")  # noqa: SIM115
    except OSError as exc:
        print(f"replay: cannot read {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    encoder = msgspec.json.Encoder()
    bad = 0
    out = sys.stdout.buffer
    with stream:
        for item in replay_lines(stream, chained=not args.recorded_state):
            if isinstance(item, BadLine):
                bad += 1
                print(f"{args.trace}:{item.line}: {item.error}", file=sys.stderr)
                continue
            out.write(encoder.encode(item) + b"\n")
    out.flush()
    if args.plot is not None and args.trace != "-":
        _plot(Path(args.trace), args.plot, chained=not args.recorded_state)
    if bad:
        print(f"replay: {bad} bad line(s) skipped", file=sys.stderr)
    return 1 if bad else 0


def _plot(trace: Path, png: Path, *, chained: bool) -> None:
    """The same picture as a lab scenario (supervisor/lab/plot.py), from a trace."""
    from supervisor.lab.plot import draw
    from supervisor.lab.timeline import timeline_from_trace

    with open(trace, "rb") as lines:
        timeline = timeline_from_trace(lines, trace.name, chained=chained)
    draw(timeline, png, title=f"replay of {trace.name}")
    print(f"replay: drew {len(timeline.points)} ticks to {png}", file=sys.stderr)
