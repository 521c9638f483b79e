"""`python -m supervisor lab [SCENARIO ...]`: the pressure lab on this machine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

import msgspec

HELP = """\
Runs named scenarios against real workers on this machine: generated models
(16-64 MiB, cached in --models), a custom ceiling sized from the usage each
scenario measures, fire drills for growth. Each scenario records its
timeline (samples, levels, limits, decisions, events), checks the decisions
the SPEC rules call for, and draws a PNG of it into --out. With no scenario
named, all of them run and a verdict table is printed; the exit status is 1
when any scenario fails.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from supervisor.lab.scenarios import SCENARIOS

    parser.description = (parser.description or "") + "\n\n" + HELP + "\nScenarios:\n" + "\n".join(
        f"  {s.name:22s} {s.rules:14s} {s.summary}" for s in SCENARIOS)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="scenarios to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("lab-out"), help="where PNGs and JSON go (default ./lab-out)")
    parser.add_argument("--models", type=Path, default=None,
                        help="where generated models are cached (default: OUT/models)")
    parser.add_argument("--json", action="store_true", help="one JSON object per scenario instead of the table")


def run(args: argparse.Namespace) -> int:
    from supervisor.lab.runner import ScenarioResult, run_scenarios
    from supervisor.lab.scenarios import by_name

    try:
        scenarios = by_name(args.scenarios)
    except KeyError as exc:
        print(f"lab: {exc.args[0]}", file=sys.stderr)
        return 2
    if not args.verbose:
        logging.getLogger().setLevel(logging.ERROR)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    models = args.models or out / "models"
    models.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def report(r: ScenarioResult) -> None:
        if args.json:
            sys.stdout.buffer.write(msgspec.json.encode(msgspec.structs.replace(r, timeline=None)) + b"\n")
            sys.stdout.flush()
            return
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name:22s} {r.rules:16s} {r.seconds:5.1f} s  {r.png}", flush=True)
        for c in r.checks:
            if not c.passed:
                print(f"      failed: {c.name}: {c.detail}", flush=True)
        if r.error:
            print(f"      error: {r.error}", flush=True)

    results = asyncio.run(run_scenarios(scenarios, out, models, on_result=report))
    wall = time.monotonic() - started
    passed = sum(r.passed for r in results)
    if not args.json:
        print()
        print(verdict_table(results))
        print(f"lab: {passed}/{len(results)} scenarios passed in {wall:.0f} s (wall); pictures in {out}/")
    return 0 if passed == len(results) else 1


def verdict_table(results) -> str:
    rows = ["| scenario | rules | verdict | checks | seconds | figures |", "|---|---|---|---|---|---|"]
    for r in results:
        figures = ", ".join(f"{k} {v:.3g}" for k, v in r.figures.items())
        ok = sum(c.passed for c in r.checks)
        rows.append(f"| {r.name} | {r.rules} | {'PASS' if r.passed else 'FAIL'} | {ok}/{len(r.checks)} | "
                    f"{r.seconds:.1f} | {figures} |")
    return "\n".join(rows)
