"""Wall time of one policy tick in two or more source trees, interleaved, as medians and ratios.

On a shared, loaded machine one run of `scripts/bench_policy.py` moves by 2x
from the next; comparing two trees from separate runs says nothing. This runs
one scenario at one worker count (default: pressure at 64, the goal's figure)
in each tree in turn, ROUNDS times (tree A, tree B, tree A, ...), each in a
fresh process that imports that tree's own policy and its own bench_policy.py,
and prints each tree's median of the rounds and its ratio to the first tree.

    python scripts/bench_policy_compare.py [--scenario pressure] [--workers 64] [--rounds 7] TREE [TREE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_policy_instructions import LOAD_TREE_BENCH  # noqa: E402

# Run in a fresh process, in the tree under test: the best mean us/tick of that tree's bench.
_DRIVER = LOAD_TREE_BENCH + """
print(bench.time_tick(getattr(bench, scenario)(n), float(sys.argv[4])))
"""


def one_run(python: str, tree: Path, scenario: str, n: int, budget: float) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([python, "-c", _DRIVER, str(tree), scenario, str(n), str(budget)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench failed in {tree}:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="checkouts of this repository")
    parser.add_argument("--scenario", default="pressure", choices=("quiet", "steady", "pressure"))
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of ticks per timed run")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    runs: dict[Path, list[float]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            runs[tree].append(one_run(sys.executable, tree, args.scenario, args.workers, args.budget))
    first = statistics.median(runs[trees[0]])
    for tree in trees:
        median = statistics.median(runs[tree])
        spread = ", ".join(f"{x:.1f}" for x in runs[tree])
        print(f"{str(tree):40s} {args.scenario} {args.workers} workers: median {median:7.1f} us/tick "
              f"({median / first:.2f}x the first) [{spread}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
