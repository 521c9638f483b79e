"""What the decode batch holds and what a decode step allocates while requests join and leave.

    python scripts/bench_join_memory.py [--model DIR | --size 4MB] [--requests 24] [--stagger 6]

In process, one engine, `--requests` greedy requests of different prompt
lengths and different max_tokens, so they leave one after another; they
arrive all at once (prefilled together, joining together) and then, in a
second round, one every `--stagger` steps (joining a batch that runs). Each
round runs twice in the same process: with the batch's growth of the first
cut of rows in place (`PREVIOUS`: rows by half, positions in 256-token steps,
half the window as room behind, no compaction) and with the current one.

Per round it prints:

- **buffers / live KV**: the batch's buffers (`nbytes`, capacity x length)
  over its live rows' own KV (`live_nbytes`), averaged over the decode
  steps, and at the step where the buffers peak;
- the peak of the buffers and of the live KV (MiB), and the relayouts
  (whole-batch copies: growth and compaction);
- **worst step**: for every step that neither relaid the buffers out nor
  ran with fewer than two rows, nor ran a prefill chunk, MLX's peak memory
  over the active memory before the step. Before rows in place (mlx-lm's
  `BatchKVCache`: `extend` on a join, `filter` on a leave) it was a copy of
  the whole batch; now it is about a row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.limits import Limits  # noqa: E402
from shared.sizes import parse_size  # noqa: E402

MiB = 2**20


def run_round(model: Any, tokenizer: Any, requests: int, stagger: int, growth: Any) -> str:
    """One engine, `requests` requests (arriving `stagger` steps apart, 0 = at once): the figures."""
    import mlx.core as mx

    from worker.engine import Engine

    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0, max_concurrency=max(1, requests))
    engine.decode.batch.growth = growth
    limits = Limits(max_concurrency=max(1, requests))
    ids = engine.encode_prompt("Once upon a time there was a memory guard that " * 4)
    batch = engine.decode.batch
    worst = held = live = peak_held = peak_live = steps = 0
    live_at_peak = 0
    step = 0
    while step <= stagger * requests or engine.has_work:
        for i in range(requests):
            if i * stagger == step:
                engine.submit(f"r{i}", ids[: 10 + 3 * i], max_tokens=200 + 7 * i)
        step += 1
        mx.reset_peak_memory()
        before, relayouts, rows = mx.get_active_memory(), batch.relayouts, len(batch)
        prefilled = engine.prompt_tokens_processed
        engine.step(limits, lambda: 0)
        decode_only = engine.prompt_tokens_processed == prefilled  # a prefill chunk's activations are G2's
        if decode_only and rows > 1 and batch.relayouts == relayouts:
            worst = max(worst, mx.get_peak_memory() - before)
        if len(batch):
            steps += 1
            held += batch.nbytes
            live += batch.live_nbytes
            if batch.nbytes > peak_held:
                peak_held, live_at_peak = batch.nbytes, batch.live_nbytes
            peak_live = max(peak_live, batch.live_nbytes)
    return (f"buffers / live KV {held / max(1, live):.2f} mean, {peak_held / max(1, live_at_peak):.2f} at the "
            f"buffers' peak; buffers up to {peak_held / MiB:.2f} MiB, live KV up to {peak_live / MiB:.2f} MiB; "
            f"{batch.relayouts} relayouts; worst step {worst / MiB:.2f} MiB over active ({steps} decode steps)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local MLX model folder (default: a generated one)")
    parser.add_argument("--size", default="4MB", help="weights of the generated model (default 4MB)")
    parser.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    parser.add_argument("--stagger", type=int, default=6, help="steps between arrivals in round 2 (default 6)")
    args = parser.parse_args(argv)
    import mlx_lm

    from worker.batch import PREVIOUS, Growth

    path = args.model or bench_model(f"engine-{parse_size(args.size)}-float32", parse_size(args.size), 11, "float32")
    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(path)))  # no config asked for
    for arrival, stagger in (("together", 0), (f"one every {args.stagger} steps", args.stagger)):
        for name, growth in (("previous", PREVIOUS), ("now", Growth())):
            print(f"{args.requests} requests {arrival}, {name:>8} growth: "
                  f"{run_round(model, tokenizer, args.requests, stagger, growth)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
