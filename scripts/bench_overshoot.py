"""How far over the ceiling a fast grower gets while the guard is stopping another model.

Issue 9: the policy counted a draining worker's memory as already gone and
took no other action until that worker had exited, so a grower in another
model ran over the ceiling for as long as the stop took. This runs the lab's
`grow-while-stopping` scenario (a 1 GiB/s fire drill in a busy model while
the guard stops an idle one, custom ceiling = usage / 0.93) several times on
real workers and reports the peak of (group usage - ceiling) / ceiling seen
in the recorded timeline (10 ms samples from the ledger).

    python scripts/bench_overshoot.py [--trials 5] [--models DIR]

Last line: `overshoot max X% median Y% of the ceiling (N trials)`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.lab.runner import make_models, run_one  # noqa: E402
from supervisor.lab.scenarios import by_name  # noqa: E402


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--models", type=Path, default=None, help="cache of generated models")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    scenario = by_name(["grow-while-stopping"])[0]
    with tempfile.TemporaryDirectory(prefix="mv-over-") as tmp:
        paths = make_models(args.models or Path(tmp), [scenario])
        overs, ceilings = [], []
        for i in range(args.trials):
            r = await run_one(scenario, paths, None)
            over = r.figures.get("overshoot", float("nan"))
            ceiling = r.timeline.points[-1].ceiling if r.timeline and r.timeline.points else 0
            overs.append(over)
            ceilings.append(ceiling)
            checks = ", ".join(f"{c.name}: {'ok' if c.passed else 'NO'}" for c in r.checks)
            print(f"trial {i + 1}: overshoot {over:.1%} of a {ceiling / 2**20:.0f} MiB ceiling ({checks})", flush=True)
    print(f"overshoot max {max(overs):.1%} median {statistics.median(overs):.1%} of the ceiling ({len(overs)} trials)")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
