"""scripts/chaos.py runs and reports (issue 16): the quickest scenarios only,
so the slow suite knows the script still works; the full run is by hand."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_issue16_chaos_smoke_prints_a_table_and_a_clean_headline():
    out = subprocess.run([sys.executable, "scripts/chaos.py", "--quick", "--only", "configs", "http-fuzz"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("scenario") and any(line.startswith("configs") for line in lines)
    headline = re.fullmatch(r"chaos: (\d+) requests, (\d+) hung, (\d+) false kills, (\d+) 5xx, (\d+) orphans",
                            lines[-1])
    assert headline is not None, lines[-1]
    requests, hung, false_kills, e5xx, orphans = map(int, headline.groups())
    assert requests > 50 and (hung, false_kills, e5xx, orphans) == (0, 0, 0, 0)
