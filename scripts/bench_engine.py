"""Engine decode throughput against plain in-process mlx_lm on the same model and prompt.

    python scripts/bench_engine.py [--model DIR ...] [--tokens N] [--repeats R]

Why: the serving path (engine + ZeroMQ + HTTP) is held to >= 90% of plain
mlx_lm throughput, so the engine alone must cost next to nothing per token.
Both sides decode greedily with the same prompt; throughput is counted from
the first generated token to the last (prompt processing excluded on both
sides), best of R runs (as timeit does: on a shared machine the best run is
the one least disturbed), runs alternated so drift hits both alike; medians
are printed too.
Without --model, it generates a 16 MiB float16 and a 200 MB float32 model
(~50M parameters; float32 because MLX's CPU backend decodes it ~5x faster than
float16) into a temporary directory. The last line is
`engine/mlx_lm decode: X% (...)`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    from modelfiles.modelgen import make_model
except ImportError:  # run as a file from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from modelfiles.modelgen import make_model

from shared.limits import Limits
from shared.protocol import Finished, TokenOut
from shared.sizes import parse_size

PROMPT = "Once upon a time, in a library full of old books, there lived a small cat who"


def bench_mlx_lm(model, tokenizer, prompt: list[int], tokens: int) -> float:
    """Tokens/s of mlx_lm.stream_generate after its first token."""
    from mlx_lm import stream_generate

    first = last = 0.0
    count = 0
    for _response in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        now = time.perf_counter()
        if count == 0:
            first = now
        last = now
        count += 1
    return (count - 1) / (last - first)


def bench_engine(model, tokenizer, prompt: list[int], tokens: int) -> float:
    """Tokens/s of the engine's step loop after its first token (guard off, one request)."""
    from worker.engine import Engine

    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0)
    engine.submit("bench", prompt, max_tokens=tokens)
    limits = Limits(max_concurrency=1)
    first = last = 0.0
    count = 0
    done = False
    while not done:
        for event in engine.step(limits, _zero):
            if isinstance(event, TokenOut):
                now = time.perf_counter()
                if count == 0:
                    first = now
                last = now
                count += 1
            elif isinstance(event, Finished):
                done = True
    return (count - 1) / (last - first)


def _zero() -> int:
    return 0


def compare(path: Path, tokens: int, repeats: int) -> float:
    import mlx_lm

    loaded = mlx_lm.load(str(path))  # (model, tokenizer): no config asked
    model, tokenizer = loaded[0], loaded[1]
    prompt = tokenizer.encode(PROMPT)
    bench_mlx_lm(model, tokenizer, prompt, 8)  # warm up both paths
    bench_engine(model, tokenizer, prompt, 8)
    plain, ours = [], []
    for _ in range(repeats):
        plain.append(bench_mlx_lm(model, tokenizer, prompt, tokens))
        ours.append(bench_engine(model, tokenizer, prompt, tokens))
    p, o = max(plain), max(ours)
    pm, om = statistics.median(plain), statistics.median(ours)
    print(f"{path.name}: mlx_lm {p:8.1f} tok/s   engine {o:8.1f} tok/s   ratio {o / p:6.1%}   "
          f"(per token: mlx_lm {1e3 / p:.3f} ms, engine {1e3 / o:.3f} ms; medians {pm:.1f} / "
          f"{om:.1f} tok/s = {om / pm:.1%}; {tokens} tokens x {repeats})")
    return o / p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", type=Path, help="model directory (repeatable)")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        models = args.model or []
        if not models:
            for name, size, dtype in (("gen-16MiB-f16", "16MiB", "float16"),
                                      ("gen-200MB-f32", "200MB", "float32")):
                make_model(Path(tmp) / name, parse_size(size), 0, dtype=dtype)
                models.append(Path(tmp) / name)
        ratios = [compare(path, args.tokens, args.repeats) for path in models]
    print(f"engine/mlx_lm decode: {min(ratios):.1%} (worst of {len(ratios)} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
