"""The real memory peak of a chunked prefill beside the prefill guard's estimate (SPEC G1/G2).

    python scripts/bench_prefill_peak.py [--quick] [--models 4MiB:float32,20MiB:float16]
                                         [--lengths 64,1024] [--chunks 256,512] [--json FILE]

For each generated model (`modelfiles.modelgen`, cached under the benchmarks'
model folder), prompt length and chunk size, the prompt is prefilled the way
the engine does it (`worker/engine.py` `_run_chunk`): all tokens but the last
in chunks of at most CHUNK tokens, each chunk run on the generation stream
with only the KV cache evaluated, MLX's pool returned after each chunk, then
the last token's logits. Two peaks are measured, both above the state before
the prefill (weights resident, empty cache):

* MLX: `mx.get_peak_memory()` after `mx.reset_peak_memory()`, less the
  active bytes before;
* footprint: the process's peak resident set (`VmHWM`, reset through
  `/proc/self/clear_refs`) less its resident set before (Linux only; "-"
  elsewhere). This is what the guard's usage (SPEC U1) sees.

Beside them: the guard's estimate for the same length and chunk size
(`worker.prefill_guard.estimate_prefill_peak` with the prior of
`worker.prefill_cost.prior_cost`, which is what G1 uses before anything was
measured) and estimate / peak, where peak is the larger of the two (and
estimate / MLX's peak). The goal (G1) is 1.00 <= estimate / peak <= 1.25.

On the 2-core CPU machines with MLX's reference BLAS a 3,400-token prompt on
a 20 MiB float32 model takes one to three minutes; the default matrix keeps
the ~100 MiB model's prompts short and takes the best part of an hour there
(the README's table came from five smaller runs, listed there). `--quick`
runs a few rows in a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import bench_model, proc_status  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import format_size, parse_size  # noqa: E402

DEFAULT_MODELS = "4MiB:float32,4MiB:float16,20MiB:float32,20MiB:float16,100MiB:float32"
DEFAULT_LENGTHS = "64,256,1024,1800,3400"
DEFAULT_CHUNKS = "256,512,1024,2048"
BIG_MODEL = 64 * 1024 * 1024   # from this size on, prompts stop at BIG_LENGTH tokens
BIG_LENGTH = 1024
SLOW_LENGTH = 1800             # 20 MiB float16 is ~3x slower than float32: stop here


def _reset_hwm() -> bool:
    """Linux: writing 5 to clear_refs restarts the peak resident set (VmHWM) at the current one."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def prefill_once(model, tokens: int, chunk: int, vocab: int) -> dict:
    """One prefill as the engine runs it; the MLX and footprint peaks above the start."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([(i * 7919) % (vocab - 8) + 5 for i in range(tokens)])
    mx.eval(prompt)
    cache = make_prompt_cache(model)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    hwm_ok = _reset_hwm()
    rss_before = proc_status("VmRSS")
    started = time.monotonic()
    pos = 0
    while pos < tokens - 1:
        n = min(chunk, tokens - 1 - pos)
        with mx.stream(generation_stream):
            model(prompt[pos:pos + n][None], cache=cache)
            mx.eval([c.state for c in cache])
        pos += n
        mx.clear_cache()
    with mx.stream(generation_stream):
        logits = model(prompt[-1:][None], cache=cache)[:, -1, :]
        mx.eval(logits)
    elapsed = time.monotonic() - started
    mlx_peak = mx.get_peak_memory() - before
    hwm = proc_status("VmHWM")
    footprint = hwm - rss_before if hwm_ok and hwm is not None and rss_before is not None else None
    del logits, cache
    mx.clear_cache()
    return {"mlx_peak": mlx_peak, "footprint_peak": footprint, "seconds": round(elapsed, 2)}


def _estimate(model, tokens: int, chunk: int) -> int:
    from worker import prefill_cost
    from worker.prefill_guard import estimate_prefill_peak

    return estimate_prefill_peak(tokens, prefill_cost.prior_cost(model, chunk), chunk)


def _rows_for(size: int, dtype: str, lengths: list[int], chunks: list[int]) -> list[tuple[int, int]]:
    """(length, chunk) pairs worth running: a chunk past the prompt repeats the one at its length."""
    cap = BIG_LENGTH if size >= BIG_MODEL else SLOW_LENGTH if (dtype != "float32" and size > 8 << 20) \
        else max(lengths)
    rows = []
    for length in (n for n in lengths if n <= cap):
        seen = False
        for chunk in chunks:
            if chunk >= length:
                if seen:
                    continue
                seen = True
            rows.append((length, chunk))
    return rows


def _shape_fields(config: dict) -> dict:
    """What the cost model reads from config.json, kept with each row so it can be refitted offline."""
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    return {key: config.get(key) for key in keys}


def measure_row(path: Path, length: int, chunk: int) -> dict:
    """One row, in this (fresh) process: load, warm up, prefill, estimate."""
    import mlx.core as mx
    import mlx_lm

    # without return_config, load returns (model, tokenizer) (its type also allows a config)
    model, _ = cast(tuple[Any, Any], mlx_lm.load(str(path)))
    mx.eval(model.parameters())
    config = json.loads((path / "config.json").read_text())
    prefill_once(model, 32, 32, int(config["vocab_size"]))  # first-call buffers are no prefill's cost
    measured = prefill_once(model, length, chunk, int(config["vocab_size"]))
    return {**measured, "config": _shape_fields(config), "estimate": _estimate(model, length, chunk)}


def run_model(size: int, dtype: str, lengths: list[int], chunks: list[int]) -> list[dict]:
    """Every row of one model, each in a child process of its own.

    Why a process per row: the footprint only grows when the process touches
    memory it never had; after a bigger row, freed pages stay resident and a
    smaller row's footprint delta reads 0.
    """
    path = bench_model(f"prefill-{size}-{dtype}-seed0", size, 0, dtype)
    out = []
    for length, chunk in _rows_for(size, dtype, lengths, chunks):
        child = subprocess.run(
            [sys.executable, __file__, "--row", str(path), str(length), str(chunk)],
            capture_output=True, text=True, check=False,
        )
        if child.returncode != 0:
            print(f"{format_size(size)} {dtype} {length}/{chunk}: failed: {child.stderr.strip()[-400:]}")
            continue
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        peak = max(measured["mlx_peak"], measured["footprint_peak"] or 0)
        row = {"model": f"{format_size(size)} {dtype}", "dtype": dtype, "tokens": length, "chunk": chunk,
               **measured, "ratio": round(measured["estimate"] / peak, 3) if peak else None}
        out.append(row)
        _print_row(row)
    return out


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:8.1f}"


def _print_header() -> None:
    print(f"{'model':<18} {'tokens':>6} {'chunk':>5} {'MLX MiB':>8} {'fp MiB':>8} {'est MiB':>8} "
          f"{'est/peak':>8} {'est/MLX':>8} {'s':>6}", flush=True)


def _print_row(row: dict) -> None:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:8.2f}"
    mlx = f"{row['estimate'] / row['mlx_peak']:8.2f}" if row["mlx_peak"] else "-"
    print(f"{row['model']:<18} {row['tokens']:>6} {row['chunk']:>5} {_mib(row['mlx_peak'])} "
          f"{_mib(row['footprint_peak'])} {_mib(row['estimate'])} {ratio:>8} {mlx:>8} {row['seconds']:>6}",
          flush=True)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"SIZE:DTYPE,... (default {DEFAULT_MODELS})")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"prompt tokens (default {DEFAULT_LENGTHS})")
    parser.add_argument("--chunks", default=DEFAULT_CHUNKS, help=f"chunk sizes (default {DEFAULT_CHUNKS})")
    parser.add_argument("--quick", action="store_true", help="4 MiB float32 and float16, 64/1024 tokens")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--row", nargs=3, metavar=("MODEL_DIR", "TOKENS", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:  # the child of run_model: one row, printed as JSON
        print(json.dumps(measure_row(Path(args.row[0]), int(args.row[1]), int(args.row[2]))))
        return 0
    if args.quick:
        args.models, args.lengths, args.chunks = "4MiB:float32,4MiB:float16", "64,1024", "256,1024"
    lengths, chunks = _ints(args.lengths), _ints(args.chunks)
    rows: list[dict] = []
    _print_header()
    for spec in args.models.split(","):
        size_text, _, dtype = spec.partition(":")
        rows += run_model(parse_size(size_text), dtype or "float32", lengths, chunks)
    ratios = [row["ratio"] for row in rows if row["ratio"] is not None]
    if ratios:
        below = sum(1 for r in ratios if r < 1.0)
        above = sum(1 for r in ratios if r > 1.25)
        print(f"estimate / peak: min {min(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} rows; "
              f"{below} below 1.00, {above} above 1.25")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
