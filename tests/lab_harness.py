"""The pressure lab as `memvisor lab` runs it: its supervisor in a fresh process of its own.

Why not in the test's process: a scenario sizes its custom ceiling from the usage it
measures, and that usage (U2) counts the supervisor's own footprint. With the lab's
Arbiter inside pytest, the supervisor is the pytest process, which late in the slow suite
holds ~280-300 MiB (MLX and the in-process forward passes of the files before it) against
~25 MiB for a fresh one. Every watermark's distance in MiB grows with it: the P6 test's band
from soft to hard went from 30 to 46 MiB, its grower (256 MiB/s) crossed it in ~180 ms
instead of ~120, after the idle model's exit (130-250 ms), and the setup failed 5 runs in 6.
A fresh process gives each scenario the same supervisor wherever it runs in the suite.

This module is also the child's entry (`python -m tests.lab_harness NAME MODELS OUT`): the
workers the child spawns import it again (multiprocess's spawn re-imports the main module),
so its top level imports nothing heavy.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.lab.runner import Scenario, ScenarioResult

ROOT = Path(__file__).resolve().parent.parent
P6_SHORT = "grow-while-big-stops-short"


def p6_short() -> Scenario:
    """grow-while-big-stops with the grower stopping short of the ceiling: 256 MiB/s up to
    92 % of it, soft at 80 %, hard at 85 %. Only a guard that acts on the growth itself (P6),
    not on the ceiling coming near, acts on the grower before the idle model's exit."""
    from dataclasses import replace

    from shared.sizes import MiB
    from supervisor.lab.scenarios import by_name, grow_while_big_stops

    return replace(by_name(["grow-while-big-stops"])[0], name=P6_SHORT, soft_threshold=0.80, hard_threshold=0.85,
                   run=grow_while_big_stops(rate=256 * MiB, soft=0.80, drill_to=0.92))


def scenario(name: str) -> Scenario:
    """A lab scenario by name, or a test's variant of one."""
    from supervisor.lab.scenarios import by_name

    return p6_short() if name == P6_SHORT else by_name([name])[0]


def make_lab_models(root: Path) -> Path:
    """Every scenario's generated models (and the variants'), made once under `root`."""
    from supervisor.lab.runner import make_models
    from supervisor.lab.scenarios import SCENARIOS

    make_models(root, [*SCENARIOS, p6_short()])
    return root


def run_scenario(name: str, models: Path, out: Path, timeout: float = 300) -> ScenarioResult:
    """One scenario in a child process; its verdict, figures and timeline as it wrote them
    (`out/NAME.json`, beside its picture `out/NAME.png`)."""
    import subprocess

    import msgspec

    from supervisor.lab.runner import ScenarioResult

    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "tests.lab_harness", name, str(models), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    written = out / f"{name}.json"
    assert done.returncode == 0 and written.exists(), (
        f"the lab's process for {name} ended with {done.returncode} and no result: {done.stderr[-4000:]}")
    return msgspec.json.decode(written.read_bytes(), type=ScenarioResult)


def main(argv: list[str]) -> int:
    import asyncio
    import logging

    from supervisor.lab.runner import make_models, run_one

    name, models, out = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sc = scenario(name)
    asyncio.run(run_one(sc, make_models(Path(models), [sc]), Path(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
