"""Every lab scenario (supervisor/lab/scenarios.py) as a slow test: real
workers, a real supervisor, the messages on the wire, and the SPEC rule's
decisions checked on the recorded timeline. These are the cross-process
regression tests of issue 9: g1-evict (G1's shortfall), grow-while-stopping
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
