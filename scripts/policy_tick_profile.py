"""Where one policy tick's work goes: bytecodes executed per function and per line.

Wall time of a ~50 us function moves with the machine's load, and callgrind
(`scripts/bench_policy_instructions.py`) counts a tick's instructions without
saying which rule spent them. This counts the Python bytecodes one tick runs,
per function and, for the functions that run the most, per line, with
`sys.settrace` opcode events (deterministic: the same tree gives the same
counts on any machine). The bytecodes that walk every worker are the ones to
look at: printed per worker as well.

    python scripts/policy_tick_profile.py [--scenario pressure] [--workers 64] [--functions 12] [--lines 2]

A bytecode is not a fixed cost (a dict store costs more than a local load), so
read the shares beside the instruction count, not instead of it.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import sys
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_policy  # noqa: E402

Where = tuple[str, str]  # (file, function)


def count(scenario: str, workers: int) -> tuple[collections.Counter[Where], collections.Counter[tuple[Where, int]]]:
    """Bytecodes of one tick of `scenario` (its second snapshot, as the bench times), per function and per line."""
    _, snapshot = getattr(bench_policy, scenario)(workers)
    bench_policy.tick(snapshot)  # warm: first calls fill the caches a tick keeps (size texts, tier terms)
    per_function: collections.Counter[Where] = collections.Counter()
    per_line: collections.Counter[tuple[Where, int]] = collections.Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            where = (code.co_filename, code.co_name)
            per_function[where] += 1
            per_line[(where, frame.f_lineno)] += 1
        return trace

    sys.settrace(trace)
    try:
        bench_policy.tick(snapshot)
    finally:
        sys.settrace(None)
    return per_function, per_line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="pressure", choices=("quiet", "steady", "pressure"))
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--functions", type=int, default=12, help="functions to list")
    parser.add_argument("--lines", type=int, default=2, help="functions to break down line by line")
    args = parser.parse_args()
    per_function, per_line = count(args.scenario, args.workers)
    total = sum(per_function.values())
    root = str(Path(__file__).resolve().parent.parent) + "/"
    print(f"{args.scenario} at {args.workers} workers: {total} bytecodes in one tick "
          f"({total / args.workers:.0f} a worker)")
    for (path, name), n in per_function.most_common(args.functions):
        print(f"{n:7d} {100 * n / total:5.1f} %  {n / args.workers:6.1f}/worker  {path.replace(root, '')}:{name}")
    for where, _ in per_function.most_common(args.lines):
        print(f"\n{where[0].replace(root, '')}:{where[1]}, line by line (bytecodes a worker)")
        for (w, line), n in sorted(per_line.items(), key=lambda item: item[0][1]):
            if w == where and n >= args.workers // 2:
                print(f"{n / args.workers:6.1f}  {line:4d}  {linecache.getline(w[0], line).strip()[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
