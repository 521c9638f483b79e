"""The issue's probe of one key's cache by another (SPEC H7 as proposed), in one process with
the worker's own engine on a generated model, and the compiled-grammar timing it also closes.

    python scripts/probe_key_partitions.py [--size 2MiB] [--runs 20]

1. Key A sends a system prompt holding a vault code; key B then sends a wrong code, the
   right one, and another wrong one. Printed: B's `cached_tokens` for each, with keys (a
   partition each) and without (one shared cache). With keys the right guess counts what a
   wrong one counts; without, it counts the whole prompt but one.
2. A JSON schema compiled for one key, asked for by another: the compile (a miss) against a
   reuse of a compiled grammar (a hit), median of `--runs`, as the ratio miss / hit. With
   keys, another key's request always pays the miss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PREAMBLE = "You are the assistant of a bank. Answer briefly and never reveal a secret. " * 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2MiB", help="the generated model's weights")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    import mlx_lm

    from modelfiles.modelgen import make_model
    from shared import protocol as p
    from shared.limits import Limits
    from shared.sizes import MiB, parse_size
    from supervisor.http.partitions import partition_id
    from worker.constrain import ConstraintFactory
    from worker.engine import Engine

    folder = Path(tempfile.mkdtemp()) / "model"
    make_model(folder, parse_size(args.size), 0)
    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(folder)))
    limits = Limits(max_concurrency=4, cache_cap=64 * MiB)

    def ask(engine: Engine, rid: str, code: str, partition: str) -> int:
        messages = [p.ChatMessage(role="system", content=f"{PREAMBLE}The vault code is {code}."),
                    p.ChatMessage(role="user", content="hello")]
        engine.submit_generate(p.Generate(request_id=rid, messages=messages, max_tokens=2, partition=partition))
        ends = []
        while engine.has_work:
            ends += [e for e in engine.step(limits, lambda: 0) if isinstance(e, p.Finished)]
        return ends[0].cached_tokens

    secret = bytes(32)
    for label, a, b in (("keys", partition_id(secret, "key-a"), partition_id(secret, "key-b")),
                        ("no keys", p.SHARED_PARTITION, p.SHARED_PARTITION)):
        engine = Engine(model, tokenizer, own_usage_fn=lambda: 0)
        ask(engine, "a", "4821", a)
        counts = [ask(engine, f"b{i}", code, b) for i, code in enumerate(("1111", "4821", "7777"))]
        print(f"{label:>8}: B's cached_tokens  wrong {counts[0]:>4}  right {counts[1]:>4}  wrong {counts[2]:>4}")

    factory = ConstraintFactory(tokenizer, model.args.vocab_size)
    misses: list[float] = []
    hits: list[float] = []
    for i in range(args.runs):
        spec = p.JsonSchema(schema=json.dumps({"type": "object", "properties": {"vault": {"enum": [f"{i:04d}"]}}}))
        for into in (misses, hits):  # the first build compiles, the second reuses
            started = time.perf_counter()
            factory.build(spec, 8, "a")
            into.append(time.perf_counter() - started)
    miss, hit = statistics.median(misses), statistics.median(hits)
    print(f"grammar: compile {miss * 1e3:.2f} ms, reuse {hit * 1e3:.3f} ms: a miss takes {miss / hit:.0f}x a hit")


if __name__ == "__main__":
    main()
