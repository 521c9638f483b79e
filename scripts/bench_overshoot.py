"""How far over the ceiling a fast grower gets while the guard is stopping another model.

Why: the policy once counted a draining worker's memory as already gone and
took no other action until that worker had exited, so a grower in another
model ran over the ceiling for as long as the stop took; and the same
with the idle model much larger than the grower (its exit takes hundreds of
ms), and with the default prompt-cache budget, whose old reservation took the
workers' limits to 1 byte so no watermark sample woke the guard.

Cases (lab scenarios on real workers; the peak of (group usage - ceiling) /
ceiling in the recorded timeline, 10 ms samples from the ledger):

- `small`: `grow-while-stopping`, a 1 GiB/s drill in a busy 16 MiB model
  while a 64 MiB idle model is stopped (custom ceiling = usage / 0.93);
- `big`: `grow-while-big-stops`, a 1 GiB/s drill in a 20 MiB model while a
  300 MiB idle model is stopped, usage just under soft; run once with
  `hot_cache_max` at its default (1 GiB) and once with 0. Each trial also
  says whether the grower was acted on before the idle model's exit.

    python scripts/bench_overshoot.py [--case small|big|all] [--trials 3] [--models DIR]

Last line: `overshoot max X% median Y% of the ceiling (N trials)`; for `big`
also `grower acted on first in K/N trials`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.sizes import GiB  # noqa: E402
from supervisor.lab.runner import Scenario, make_models, run_one  # noqa: E402
from supervisor.lab.scenarios import by_name  # noqa: E402


def _cases(case: str) -> list[tuple[str, Scenario]]:
    out: list[tuple[str, Scenario]] = []
    if case in ("small", "all"):
        out.append(("small, hot_cache_max 0", by_name(["grow-while-stopping"])[0]))
    if case in ("big", "all"):
        big = by_name(["grow-while-big-stops"])[0]
        out.append(("big, hot_cache_max 1GiB", dataclasses.replace(big, hot_cache_max=GiB)))
        out.append(("big, hot_cache_max 0", dataclasses.replace(big, hot_cache_max=0)))
    return out


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("small", "big", "all"), default="all")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--models", type=Path, default=None, help="cache of generated models")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    cases = _cases(args.case)
    overs: list[float] = []
    first = total_big = 0
    with tempfile.TemporaryDirectory(prefix="mv-over-") as tmp:
        paths = make_models(args.models or Path(tmp), [sc for _, sc in cases])
        for label, scenario in cases:
            for i in range(args.trials):
                r = await run_one(scenario, paths, None)
                over = r.figures.get("overshoot", float("nan"))
                ceiling = r.timeline.points[-1].ceiling if r.timeline and r.timeline.points else 0
                overs.append(over)
                line = f"{label} trial {i + 1}: overshoot {over:.1%} of a {ceiling / 2**20:.0f} MiB ceiling"
                if scenario.name == "grow-while-big-stops":
                    total_big += 1
                    before = next((c.passed for c in r.checks if c.name.endswith("had exited")), False)
                    first += before
                    f = r.figures
                    line += (f"; grower acted on before the idle model's exit: {'yes' if before else 'NO'}"
                             f" (acted {f.get('acted_after_hard_ms', float('nan')):.0f} ms after hard, "
                             f"{f.get('acted_before_exit_ms', float('nan')):.0f} ms before the exit; "
                             f"drill ran at {f.get('grower_mib_per_s', float('nan')):.0f} MiB/s)")
                failed = [c.name for c in r.checks if not c.passed]
                print(line + (f" [failed: {'; '.join(failed)}]" if failed else ""), flush=True)
    if total_big:
        print(f"grower acted on first in {first}/{total_big} trials")
    print(f"overshoot max {max(overs):.1%} median {statistics.median(overs):.1%} of the ceiling ({len(overs)} trials)")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
