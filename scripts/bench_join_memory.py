"""What a decode step allocates while requests join and leave the batch (issue 22).

    python scripts/bench_join_memory.py [--model DIR | --size 4MB] [--requests 24]

In process, one engine, `--requests` greedy requests of different prompt
lengths and different max_tokens, so they join one after another and leave
one after another. For every step that neither grew the batch's buffers nor
ran with fewer than two rows, nor ran a prefill chunk, MLX's peak memory over the active memory
before the step is recorded; the worst is printed beside the batch's largest
size. Before issue 22 (mlx-lm's `BatchKVCache`: `extend` on a join, `filter`
on a leave) the worst step was a copy of the whole batch; now it is about a
row. It also prints what the buffers hold over the rows' own KV (capacity x
positions against the tokens each row has), averaged over the steps. Last line:

    worst step peak over active: X MiB; batch buffers up to Y MiB (Z relayouts)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local MLX model folder (default: a generated one)")
    parser.add_argument("--size", default="4MB", help="weights of the generated model (default 4MB)")
    parser.add_argument("--requests", type=int, default=24, help="requests (default 24)")
    args = parser.parse_args(argv)
    import mlx.core as mx
    import mlx_lm

    from worker.engine import Engine

    path = args.model or bench_model(f"engine-{parse_size(args.size)}-float32", parse_size(args.size), 11, "float32")
    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(path)))  # no config asked for
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0, max_concurrency=max(1, args.requests))
    limits = Limits(max_concurrency=max(1, args.requests))
    ids = engine.encode_prompt("Once upon a time there was a memory guard that " * 4)
    for i in range(args.requests):
        engine.submit(f"r{i}", ids[: 10 + 3 * i], max_tokens=200 + 7 * i)
    batch = engine.decode.batch
    worst = largest = held = live = 0
    while engine.has_work:
        mx.reset_peak_memory()
        before, relayouts, rows = mx.get_active_memory(), getattr(batch, "relayouts", 0), len(batch)
        prefilled = engine.prompt_tokens_processed
        engine.step(limits, lambda: 0)
        largest = max(largest, batch.nbytes)
        if len(batch):  # what the buffers hold against the rows' own tokens, summed over steps
            per_position = batch.nbytes // (batch.capacity * batch.length)
            held += batch.nbytes
            live += per_position * sum(batch.idx - pad for pad in batch.pads)
        decode_only = engine.prompt_tokens_processed == prefilled  # a prefill chunk's activations are G2's
        if decode_only and rows > 1 and getattr(batch, "relayouts", 0) == relayouts:
            worst = max(worst, mx.get_peak_memory() - before)
    print(f"buffers over the rows' own KV, averaged over the steps: {held / max(1, live):.2f}x")
    print(f"worst step peak over active: {worst / 2**20:.2f} MiB; batch buffers up to {largest / 2**20:.2f} MiB "
          f"({getattr(batch, 'relayouts', 0)} relayouts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
