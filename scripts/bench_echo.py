"""What lm-evaluation-harness's loglikelihood request costs the worker, as ratios in one run.

Its payload is `echo` with `logprobs` and `max_tokens` 1 (worker/echo.py scores the prompt, then
the request generates its one token): this times it against the same prompt with no echo
(`max_tokens` 1), with the prompt cache off (the generation prefills the prompt again) and on
(it reuses the scoring's KV), and `max_tokens` 0 (the scoring alone), in one process, on the
engine with no supervisor, best of `--runs`.

    python scripts/bench_echo.py MODEL_DIR [--tokens 400] [--runs 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from shared.limits import Limits
from shared.protocol import Generate
from shared.sizes import MiB
from worker import blas


def timed(engine, cmd: Generate, limits: Limits) -> float:
    engine.prompt_cache.drop_lru(0)  # every run starts from an empty prompt cache
    started = time.perf_counter()
    engine.submit_generate(cmd)
    while engine.has_work:
        engine.step(limits, lambda: 0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=400, help="prompt length in tokens")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    blas.preload()  # the workers' BLAS, bound before MLX is imported (by worker.engine)
    from worker.engine import Engine

    engine = Engine.load(args.model)
    words = "the river runs past the old mill and the miller counts his sacks of flour "
    prompt = engine.tokenizer.encode(words * (args.tokens // 10 + 1))[:args.tokens]
    off, on = Limits(max_concurrency=4), Limits(max_concurrency=4, cache_cap=256 * MiB)
    cases: dict[str, tuple[dict[str, Any], Limits]] = {
        "plain max_tokens 1": (dict(max_tokens=1), off),
        "echo+logprobs max_tokens 0": (dict(max_tokens=0, echo=True, logprobs=True, top_logprobs=1), off),
        "echo+logprobs max_tokens 1, cache off": (dict(max_tokens=1, echo=True, logprobs=True, top_logprobs=1), off),
        "echo+logprobs max_tokens 1, cache on": (dict(max_tokens=1, echo=True, logprobs=True, top_logprobs=1), on),
    }
    best: dict[str, float] = {}
    for i in range(args.runs + 1):  # the first round warms up
        for name, (fields, limits) in cases.items():
            seconds = timed(engine, Generate(request_id=f"{name}-{i}", prompt_tokens=prompt, **fields), limits)
            if i:
                best[name] = min(best.get(name, seconds), seconds)
    base = best["plain max_tokens 1"]
    print(f"{args.model.name}: a {len(prompt)}-token prompt, best of {args.runs}")
    for name, seconds in best.items():
        print(f"  {name:42s} {seconds * 1000:9.1f} ms  {seconds / base:5.2f}x plain")


if __name__ == "__main__":
    main()
