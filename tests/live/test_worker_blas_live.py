"""OpenBLAS in real worker processes: the library the worker really maps is the one its
hello names, and greedy tokens do not change with it (tests/test_blas.py holds the rest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared import protocol as p
from shared.probe import blas_plan as found
from tests.blas_harness import linux_only, mapped_paths

pytestmark = [pytest.mark.slow, linux_only]

ROOT = Path(__file__).resolve().parents[2]


def test_worker_hello_names_openblas_and_the_worker_maps_it(tiny_model, tmp_path):
    from tests.worker_harness import FakeSupervisor

    with FakeSupervisor(tmp_path, tiny_model, "w#blas") as sup:
        hello = sup.recv(p.Hello)
        sup.recv(p.Loaded)
        mapped = mapped_paths(hello.pid)
    plan = found.plan()
    assert plan.kind in ("renamed", "system") and plan.ready
    # the kernel maps the file the worker verified (each test's MEMVISOR_CACHE/blas holds hard links to one copy)
    assert os.path.realpath(plan.load_path) in mapped, sorted(m for m in mapped if "blas" in m)
    assert "OpenBLAS" in hello.blas and plan.load_path in hello.blas


GREEDY = """
import json, sys
from worker import blas
info = blas.preload()
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
model, tok = mlx_lm.load(sys.argv[1])
out = {}
for prompt in ("the quick brown fox", "memory is a budget " * 12):
    ids = mx.array(tok.encode(prompt))
    out[prompt] = [int(t) for t, _ in generate_step(ids, model, max_tokens=24)]
print(json.dumps({"blas": info.kind, "tokens": out}))
"""


def test_greedy_tokens_are_identical_with_openblas_and_with_the_stock_blas(tmp_path):
    """float32 sums in another order differ in the last bits; greedy tokens of the test models must not."""
    from modelfiles.modelgen import make_model

    model = tmp_path / "f32"
    make_model(model, 4 * 2**20, 5, dtype="float32")
    runs = {}
    for choice in ("stock", "auto"):
        out = subprocess.run([sys.executable, "-c", GREEDY, str(model)], cwd=ROOT, capture_output=True,
                             text=True, check=True, env=os.environ | {found.ENV: choice}, timeout=300)
        runs[choice] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["stock"]["blas"] == "stock" and runs["auto"]["blas"] in ("renamed", "system")
    assert runs["auto"]["tokens"] == runs["stock"]["tokens"]
