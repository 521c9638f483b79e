"""What the first pass of each width costs in a fresh process: kernel builds on a GPU.

    python scripts/bench_first_pass.py [--model DIR | --size 100MiB --quantize 4] [--widths 1,2,3,...]
                                       [--processes 2] [--kv 300]

Why: on an H100 the first speculative edit after a worker loaded decoded at
3 tok/s where the next ones ran at 330 (scripts/bench_speculative.py, same
prompt and reply each round): a check of K guesses is a pass of K+1 tokens, and
MLX builds kernels the first time it meets a shape it has not compiled. This
prints, per pass width, the first pass's seconds against the second's, in
`--processes` fresh processes one after the other (a second process that is
fast too means the builds are cached on disk, not only in the process).

Each process loads the model, prefills a `--kv`-token prompt, then for each
width in turn runs one pass of that many tokens over the KV twice (trimming
the KV back after each), timing both. The widths run in the order given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WIDTHS = "1,2,3,4,5,6,8,9,12,16,17,24,33"


def child(model_dir: str, widths: list[int], kv: int) -> dict[str, list[float]]:
    """One fresh process's timings: width -> [first, second] seconds."""
    from worker import blas

    blas.preload()
    from bench_speculative import primed, timed_pass  # the same passes as its --passes

    started = time.perf_counter()
    model, cache = primed(model_dir, kv)
    out: dict[str, list[float]] = {"load_and_prefill": [time.perf_counter() - started]}
    for width in widths:
        out[str(width)] = [timed_pass(model, cache, width) for _ in range(2)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an MLX model folder (default: a generated quantized one)")
    parser.add_argument("--size", default="100MiB", help="weights of the generated model (default 100MiB)")
    parser.add_argument("--quantize", type=int, default=4, help="bits of the generated model (0: float16)")
    parser.add_argument("--widths", default=WIDTHS, help=f"pass widths in tokens, in order (default {WIDTHS})")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes, one after the other")
    parser.add_argument("--kv", type=int, default=300, help="tokens in the KV before the passes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    if args.child:
        print(json.dumps(child(str(args.model), widths, args.kv)))
        return 0
    model = args.model or generated(args.size, args.quantize)
    print(f"model {model}; widths {widths}; KV {args.kv} tokens", flush=True)
    runs = []
    for i in range(args.processes):
        proc = subprocess.run([sys.executable, __file__, "--child", "--model", str(model), "--widths", args.widths,
                               "--kv", str(args.kv)], capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"process {i} failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"process {i}: load and prefill {runs[-1]['load_and_prefill'][0]:.2f} s", flush=True)
    print("width   " + "   ".join(f"proc {i}: first / second (ms)" for i in range(len(runs))))
    for width in widths:
        cells = [f"{run[str(width)][0] * 1e3:10.1f} / {run[str(width)][1] * 1e3:8.1f}" for run in runs]
        print(f"{width:5d}   " + "   ".join(cells), flush=True)
    firsts = [sum(run[str(w)][0] - run[str(w)][1] for w in widths) for run in runs]
    print("first-use cost over every width (sum of first - second): "
          + ", ".join(f"proc {i} {s:.2f} s" for i, s in enumerate(firsts)))
    return 0


def generated(size: str, bits: int) -> Path:
    """A generated float16 llama of `size` (quantized to `bits` when not 0), made once."""
    from _serve import bench_model

    from shared.sizes import parse_size

    return bench_model(f"first-pass-{parse_size(size)}-q{bits}", parse_size(size), 11, "float16", bits=bits)


if __name__ == "__main__":
    sys.exit(main())
