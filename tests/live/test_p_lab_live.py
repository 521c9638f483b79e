"""Every lab scenario (supervisor/lab/scenarios.py) as a slow test: real
workers, a real supervisor, the messages on the wire, and the SPEC rule's
decisions checked on the recorded timeline. These are the cross-process
regression tests of the guard's contracts: g1-evict (G1's shortfall), grow-while-stopping
(P6 at hard while a stop is under way), emergency-mark (P6.3), pool-grace
(U1 counting the pool, P4)."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.lab.runner import make_models, run_one
from supervisor.lab.scenarios import SCENARIOS, by_name

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def lab_models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("lab-models"), list(SCENARIOS))


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_lab_scenario(name, lab_models, tmp_path):
    result = asyncio.run(run_one(by_name([name])[0], lab_models, tmp_path))
    failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
    assert result.passed, f"{name}: {failed or result.error}"
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000  # the picture was drawn


def test_p6_a_grower_at_hard_is_acted_on_before_a_big_idle_model_exits(lab_models, tmp_path):
    """At hard the guard waited for a 300 MiB idle model's exit (which
    takes hundreds of ms) before acting on a grower, because the stop under way
    was guessed to land in time. Here the grower (256 MiB/s asked) stops short of the
    ceiling, at 92 % of it, with hard at 85 %: only a guard that acts on the
    growth itself acts on it before that exit.

    The idle model's exit takes 190-690 ms here, and the grower needs ~120 ms
    from soft to hard: on a fast exit (CI once) hard is never reached and the
    run says nothing about P6. Such a run is repeated (at most three), and a
    run whose setup held is judged on every check. Late in the full slow suite
    the grower also failed to reach hard in all three (the idle exit took
    3.2-3.5 s, not yet explained), in 3 of 4 full runs on 2026-12-05: then
    the test skips, saying so, rather than judge P6 on runs that cannot."""
    from dataclasses import replace

    from supervisor.lab.scenarios import grow_while_big_stops

    base = by_name(["grow-while-big-stops"])[0]
    sc = replace(base, name="grow-while-big-stops-short", soft_threshold=0.80, hard_threshold=0.85,
                 run=grow_while_big_stops(rate=256 * 2**20, soft=0.80, drill_to=0.92))
    for _attempt in range(3):
        result = asyncio.run(run_one(sc, lab_models, None))
        failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
        if not any(name.startswith("setup:") for name in failed):
            break
    else:  # three runs that say nothing about P6: the machine never made the race this test needs
        pytest.skip(f"the setup never held in 3 runs (hard not reached before the idle model's exit): {failed}")
    assert result.passed, f"{failed or result.error} {result.figures}"
