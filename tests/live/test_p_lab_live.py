"""Every lab scenario (supervisor/lab/scenarios.py) as a slow test: real
workers, a real supervisor, the messages on the wire, and the SPEC rule's
decisions checked on the recorded timeline. These are the cross-process
regression tests of the guard's contracts: g1-evict (G1's shortfall), grow-while-stopping
(P6 at hard while a stop is under way), emergency-mark (P6.3), pool-grace
(U1 counting the pool, P4).

Each scenario runs in a fresh process, as `memvisor lab` runs it (tests/lab_harness.py
says why): its ceiling is sized from a usage that counts the supervisor itself, which
must not be the test process that the files before it have grown."""

from __future__ import annotations

import pytest

from supervisor.lab.scenarios import SCENARIOS
from tests.lab_harness import P6_SHORT, make_lab_models, run_scenario

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def lab_models(tmp_path_factory):
    return make_lab_models(tmp_path_factory.mktemp("lab-models"))


@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_lab_scenario(name, lab_models, tmp_path):
    result = run_scenario(name, lab_models, tmp_path)
    failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
    assert result.passed, f"{name}: {failed or result.error}"
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000  # the picture was drawn


def test_p6_a_grower_at_hard_is_acted_on_before_a_big_idle_model_exits(lab_models, tmp_path):
    """At hard the guard waited for a 300 MiB idle model's exit (which
    takes hundreds of ms) before acting on a grower, because the stop under way
    was guessed to land in time. Here the grower (256 MiB/s asked) stops short of the
    ceiling, at 92 % of it, with hard at 85 % (tests/lab_harness.p6_short): only a guard
    that acts on the growth itself acts on it before that exit.

    The idle model's exit takes 130-690 ms here, and the grower needs ~120 ms
    from soft to hard: on a fast exit (CI once) hard is never reached and the
    run says nothing about P6. Such a run is repeated (at most three), and a
    run whose setup held is judged on every check; three that never held skip,
    saying so, rather than judge P6 on runs that cannot. (Run inside pytest, late
    in the slow suite, the setup failed in nearly every run: the test process,
    then the supervisor, had grown to ~300 MiB and widened the band to ~180 ms.
    The "exit at 3.1 s" those skips printed is the time since the run began.)"""
    for attempt in range(3):
        result = run_scenario(P6_SHORT, lab_models, tmp_path / f"run{attempt}")
        failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
        if not any(name.startswith("setup:") for name in failed):
            break
    else:  # three runs that say nothing about P6: the machine never made the race this test needs
        pytest.skip(f"the setup never held in 3 runs (hard not reached before the idle model's exit): {failed}")
    assert result.passed, f"{failed or result.error} {result.figures}"
