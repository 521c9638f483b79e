"""Two memvisor hosts behind a real LiteLLM proxy: scripts/fleet.py's short run.

One host is pushed into refusals three times (a fire drill to hard, a tiny custom
ceiling, its worker SIGSTOPped) while plain clients that never retry send requests
through the proxy. The routing signals must be enough for an existing router to
keep every one of them served: no client-visible failure, the healthy host served
requests, the faulted host refused some (so the faults really bit) and served
again after them.

LiteLLM (the pinned release) runs from its own virtual environment, installed
into the cache on first use (pip, from the package index; ~40 s once).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_fleet_pin_is_the_one_in_pyproject():
    """One known-good release, named twice: the script's venv and the `fleet` extra."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from fleet import LITELLM_PIN

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'"litellm\[proxy\]=={re.escape(LITELLM_PIN)}"', pyproject)
    assert LITELLM_PIN != "1.107.0" and LITELLM_PIN not in ("1.82.7", "1.82.8")
    assert "litellm" not in pyproject.split("[project.optional-dependencies]")[0]  # never a core dependency


def test_fleet_behind_litellm_serves_every_request_while_one_host_refuses(tmp_path):
    out = subprocess.run([sys.executable, "scripts/fleet.py", "--quick", "--hosts", "2", "--work", str(tmp_path),
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert lines[-2].startswith("fleet: "), lines[-2]
    assert summary["failed"] == 0, (summary["failures"], out.stderr[-3000:])
    assert out.returncode == 0
    assert summary["requests"] > 50
    healthy, victim = "fleet-a", summary["victim"]
    assert victim == "fleet-b" and summary["served"][healthy] > 0
    assert [f["fault"] for f in summary["faults"]] == ["drill", "ceiling", "sigstop"]
    refused = sum(summary["refusals"][victim].values())
    assert refused > 0, summary["refusals"]  # the faults bit: the router was refused and went elsewhere
    assert summary["refusals"][healthy].get("500", 0) == 0
    assert summary["served"][victim] > 0
