"""MLX on a Linux CPU with its bundled reference BLAS vs the OpenBLAS workers load.

    python scripts/bench_blas.py [--n 1024] [--size 100MiB] [--words 680] [--skip-prefill]

1. Matmul: a float32 N×N×N matmul in MLX, each figure from a fresh process
   (the BLAS binds once, when libmlx loads): MEMVISOR_BLAS=stock (MLX's
   netlib libblas) and the workers' OpenBLAS (worker.blas.preload) with 1
   thread and with every CPU (a worker's default is one fewer than the CPUs),
   then two processes at once with each thread count (what several busy
   workers do to each other).
2. The issue's CPU prefill goal: a ~1,500-token prompt on a generated float32
   model of --size, (a) in-process mlx_lm on the stock wheel (a fresh python
   that loads the model and times prompt processing to the first token),
   (b) served: `python -m supervisor serve` on a config with that model, one
   /v1/completions request with max_tokens 1, timed from send to answer.
   The goal is (a) / (b) >= 5.

The last line is the headline:

    blas: matmul X GFLOP/s stock vs Y OpenBLAS (Z×); prefill in-process stock A s vs served B s (C×)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import parse_size  # noqa: E402

MATMUL = """
import json, os, sys, time
from worker import blas
info = blas.preload()
import mlx.core as mx
n, seconds = int(sys.argv[1]), float(sys.argv[2])
a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
mx.eval(a, b, a @ b)
reps, start = 0, time.perf_counter()
while reps == 0 or time.perf_counter() - start < seconds:
    mx.eval(a @ b)
    reps += 1
took = (time.perf_counter() - start) / reps
print(json.dumps({"gflops": 2 * n**3 / took / 1e9, "blas": info.line(), "kind": info.kind}))
"""

PREFILL = """
import json, sys, time
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
model, tok = mlx_lm.load(sys.argv[1])
ids = mx.array(tok.encode(sys.argv[2]))
start = time.perf_counter()
for _token, _ in generate_step(ids, model, max_tokens=1):
    break
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": int(ids.size)}))
"""

WORDS = ("memory pressure guard worker model cache prefix token budget ceiling supervisor "
         "allocator process prefill decode stream sample ledger policy tier reserve").split()


def python(code: str, *args: str, env: dict[str, str], timeout: float = 1800) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def env_for(choice: str, threads: int | None = None) -> dict[str, str]:
    env = os.environ | {"MEMVISOR_BLAS": choice,
                        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    return env


def matmuls(n: int, cpus: int) -> tuple[float, float]:
    """Prints each figure; returns (stock, fast with a worker's default thread count)."""
    default = max(1, cpus - 1)  # worker.blas's choice
    stock = python(MATMUL, str(n), "1", env=env_for("stock"))
    print(f"matmul {n}³ float32, stock BLAS:          {stock['gflops']:7.1f} GFLOP/s", flush=True)
    fast = {}
    for threads in sorted({1, default, cpus}):
        fast[threads] = python(MATMUL, str(n), "3", env=env_for("auto", threads))
        if fast[threads]["kind"] == "stock":
            raise SystemExit(f"no fast BLAS to measure: {fast[threads]['blas']} (see `python -m supervisor probe`)")
        print(f"matmul {n}³ float32, OpenBLAS {threads} thread(s): {fast[threads]['gflops']:7.1f} GFLOP/s "
              f"({fast[threads]['blas']})", flush=True)
    for threads in sorted({1, cpus}):
        procs = [subprocess.Popen([sys.executable, "-c", MATMUL, str(n), "3"], cwd=ROOT, text=True,
                                  env=env_for("auto", threads), stdout=subprocess.PIPE) for _ in range(2)]
        both = [json.loads(proc.communicate()[0].strip().splitlines()[-1])["gflops"] for proc in procs]
        print(f"two processes at once, {threads} thread(s) each: {both[0]:.1f} + {both[1]:.1f} "
              f"= {sum(both):.1f} GFLOP/s", flush=True)
    return stock["gflops"], fast[default]["gflops"]


def served(model: Path, prompt: str, workdir: Path) -> tuple[float, int]:
    import httpx

    body = ("[supervisor]\nheartbeat_timeout = 300\n"
            f'[[models]]\nid = "m"\npath = "{model}"\npinned = true\n')
    server = ServeProcess(body, config=workdir / "blas.toml", runtime=workdir / "rt", log=workdir / "serve.log",
                          timeout=600.0, env=env_for("auto"), stop_grace=60.0)
    try:
        with httpx.Client(timeout=1800) as client:
            sent = time.perf_counter()
            r = client.post(f"{server.base}/v1/completions",
                            json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
            took = time.perf_counter() - sent
            r.raise_for_status()
            return took, int(r.json()["usage"]["prompt_tokens"])
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1024, help="matmul size (2048 takes ~8 s a matmul on stock)")
    ap.add_argument("--size", type=parse_size, default=parse_size("100MiB"), help="prefill model's weights")
    ap.add_argument("--words", type=int, default=720, help="prompt words (~2 tokens each: ~1,500 tokens)")
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    print(f"{cpus} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    stock, fast = matmuls(args.n, cpus)
    headline = f"blas: matmul {stock:.1f} GFLOP/s stock vs {fast:.1f} OpenBLAS ({fast / stock:.1f}×)"
    if not args.skip_prefill:
        model = bench_model(f"blas-{args.size}-float32", args.size, 7, "float32")
        rng = random.Random(0)
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.words))
        inproc = python(PREFILL, str(model), prompt, env=env_for("stock"))
        print(f"prefill {inproc['tokens']} tokens in-process mlx_lm, stock BLAS: {inproc['seconds']:.1f} s",
              flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-blas-") as tmp:
            took, tokens = served(model, prompt, Path(tmp))
        print(f"prefill {tokens} tokens served by memvisor (OpenBLAS), max_tokens 1: {took:.1f} s", flush=True)
        headline += (f"; prefill {inproc['tokens']} tokens in-process stock {inproc['seconds']:.1f} s "
                     f"vs served {took:.1f} s ({inproc['seconds'] / took:.1f}×)")
    print(headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
