"""Instructions per policy tick, counted by callgrind, for one or more source trees.

Wall-clock figures for a ~50 us function are useless on a shared, loaded
machine; instruction counts are not (they move by well under 1 % run to run).
For each tree given (a checkout of this repository, e.g. a `git worktree` of
an older commit), each scenario of that tree's own `scripts/bench_policy.py`
(quiet, steady, pressure) is run under `valgrind --tool=callgrind` twice: once
building the snapshots only, once building them and running TICKS ticks. The
difference divided by TICKS is the cost of one tick, with Python's start-up and
the snapshot building taken out.

    python scripts/bench_policy_instructions.py [--workers 64] [--ticks 200] TREE [TREE ...]

With --us-per-tick REF_US the first tree is the reference: each later tree's
pressure figure is also printed as the wall time it stands for, REF_US scaled
by its instruction ratio to the first tree (the issue-21 goal: <= 50 us).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = ("quiet", "steady", "pressure")

# The start of a driver run in a fresh process: the tree under test's own bench_policy.py, as `bench`
# (argv: tree, scenario, worker count, then the driver's own). Also bench_policy_compare.py's.
LOAD_TREE_BENCH = """
import importlib.util, sys
tree, scenario, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("bench_policy", tree + "/scripts/bench_policy.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
"""

# Run inside valgrind, in the tree under test: build the scenario, tick it.
_DRIVER = LOAD_TREE_BENCH + """
ticks = int(sys.argv[4])
a, b = getattr(bench, scenario)(n)
tick = bench.tick
tick(a), tick(b)  # warm: first calls fill caches (struct types, format strings)
for _ in range(ticks // 2):
    tick(a)
    tick(b)
"""


def _instructions(python: str, tree: Path, scenario: str, n: int, ticks: int) -> int:
    """Total instructions of one run under callgrind (its 'Collected' line)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
             python, "-c", _DRIVER, str(tree), scenario, str(n), str(ticks)],
            env=env, capture_output=True, text=True, check=False)
        found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"callgrind run failed for {tree} {scenario}:\n{done.stderr[-2000:]}")
        return int(found.group(1))


def per_tick(python: str, tree: Path, scenario: str, n: int, ticks: int) -> float:
    base = _instructions(python, tree, scenario, n, 0)
    full = _instructions(python, tree, scenario, n, ticks)
    return (full - base) / (ticks // 2 * 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="checkouts of this repository")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--us-per-tick", type=float, default=None,
                        help="the first tree's measured wall us/tick (pressure), to scale the others by")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    figures: dict[tuple[Path, str], float] = {}
    for tree in args.trees:
        tree = tree.resolve()
        for scenario in scenarios:
            figures[tree, scenario] = per_tick(sys.executable, tree, scenario, args.workers, args.ticks)
            print(f"{str(tree):40s} {scenario:8s} {args.workers} workers: "
                  f"{figures[tree, scenario] / 1e3:9.1f} k instructions/tick", flush=True)
    first = args.trees[0].resolve()
    for tree in args.trees[1:]:
        tree = tree.resolve()
        for scenario in scenarios:
            ratio = figures[tree, scenario] / figures[first, scenario]
            line = f"{str(tree):40s} {scenario:8s} / {first.name}: {ratio:.2f}x"
            if args.us_per_tick is not None and scenario == "pressure":
                line += f" (stands for {args.us_per_tick * ratio:.1f} us at {args.us_per_tick} us for the first)"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
