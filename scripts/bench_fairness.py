"""Fair prefill through the real server: a short prompt sent while a long one prefills.

    python scripts/bench_fairness.py [--model DIR | --size 100MiB] [--long 4000] [--short 100]
                                     [--rounds 3] [--orders shortest,round_robin] [--before /work/main]

One model (a generated float32 one of `--size` by default), `max_concurrency` 4,
served by `python -m supervisor serve`. Per server and round, interleaved
(the order of the three kinds turns each round, so the machine's load falls on
each alike):

- **short alone**: a `--short`-token prompt, `--tokens` tokens; its TTFT;
- **long alone**: a `--long`-token prompt, `--tokens` tokens; its total time;
- **together**: the long prompt, and 1 s later the short one; the short one's
  TTFT and the long one's total time.

Every prompt is new (its first words name the round and the kind), so no prompt
cache serves a prefix. The goals of issue 33: the short one's TTFT together
<= 2 x alone, the long one's total together <= 1.25 x alone. Each server
(`--orders`: one per prefill order, `[supervisor] prefill_order`, `@SECONDS` for
its `chunk_seconds`; `--before DIR`: another checkout, e.g. main before the
change, served the same way) runs its
rounds while the others wait, and the ratios are medians of its rounds: on a
shared machine compare ratios, never seconds across runs. The whole-run figures
(each server's wall time for all its rounds) come first, then the per-kind ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import bench_model, serve_private  # noqa: E402  (scripts/ is on sys.path as the script's folder)
from _sse import stream_completion  # noqa: E402

MODEL_ID = "fair"
WORDS = ("river lamp garden keeper morning window letter harbor engine valley silver winter "
         "market bridge candle forest meadow signal lantern orchard tower pebble thunder").split()


def text_of(tokenizer, tag: str, tokens: int) -> str:
    """A prompt of about `tokens` tokens (the model's own tokenizer counts), starting with `tag`."""
    words = max(1, tokens)
    for _ in range(20):
        text = tag + " " + " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(words))
        count = len(tokenizer.encode(text).ids) + 1  # BOS
        if abs(count - tokens) <= 2:
            return text
        words = max(1, round(words * tokens / count))
    return text


async def timed(base: str, prompt: str, tokens: int, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    s = await stream_completion(f"{base}/v1/completions", body)
    return {"ttft": s.first - s.sent, "total": s.last - s.sent, "tokens": s.tokens}


async def one_round(base: str, tokenizer, args, r: int) -> dict:
    """The three kinds, in an order that turns with the round."""
    kinds = ["short", "long", "together"]
    kinds = kinds[r % 3:] + kinds[:r % 3]
    out: dict = {}
    for kind in kinds:
        tag = f"Round {r} {kind} {time.time_ns()}"
        if kind == "short":
            out["short"] = await timed(base, text_of(tokenizer, tag, args.short), args.tokens)
        elif kind == "long":
            out["long"] = await timed(base, text_of(tokenizer, tag, args.long), args.tokens)
        else:
            long_, short = await asyncio.gather(
                timed(base, text_of(tokenizer, tag + " long", args.long), args.tokens),
                timed(base, text_of(tokenizer, tag + " short", args.short), args.tokens, delay=1.0))
            out["together_long"], out["together_short"] = long_, short
    return out


def config_text(model: Path, order: str, chunk_seconds: float | None) -> str:
    extra = f"chunk_seconds = {chunk_seconds}\n" if chunk_seconds is not None else ""
    order_line = f'prefill_order = "{order}"\n' if order else ""
    return (f"[supervisor]\n{order_line}{extra}\n"
            f'[[models]]\nid = "{MODEL_ID}"\npath = "{model}"\nmax_concurrency = 4\npinned = true\n')


def summary(label: str, rounds: list[dict], wall: float) -> dict:
    med = statistics.median
    short_alone = med(r["short"]["ttft"] for r in rounds)
    short_together = med(r["together_short"]["ttft"] for r in rounds)
    long_alone = med(r["long"]["total"] for r in rounds)
    long_together = med(r["together_long"]["total"] for r in rounds)
    return {"label": label, "wall_s": wall, "short_ttft_alone_s": short_alone,
            "short_ttft_together_s": short_together, "short_ratio": short_together / short_alone,
            "long_total_alone_s": long_alone, "long_total_together_s": long_together,
            "long_ratio": long_together / long_alone, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local MLX model folder (default: a generated float32 one)")
    parser.add_argument("--size", default="100MiB", help="weights of the generated model (default 100MiB)")
    parser.add_argument("--long", type=int, default=4000, help="tokens of the long prompt (default 4000)")
    parser.add_argument("--short", type=int, default=100, help="tokens of the short prompt (default 100)")
    parser.add_argument("--tokens", type=int, default=16, help="max tokens of each reply (default 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--orders", default="shortest,round_robin",
                        help="servers: prefill orders, comma-separated, each with @SECONDS for its chunk_seconds "
                             "(e.g. shortest,shortest@1,round_robin)")
    parser.add_argument("--chunk-seconds", type=float, help="[supervisor] chunk_seconds (default: the server's)")
    parser.add_argument("--before", type=Path, help="also serve from this checkout (e.g. main before the change)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    from shared.sizes import parse_size

    model = args.model or bench_model(f"fairness-{parse_size(args.size)}-float32", parse_size(args.size), 11,
                                      "float32")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    servers = []
    for spec in filter(None, args.orders.split(",")):
        order, _, seconds = spec.partition("@")
        servers.append((spec, ROOT, order, float(seconds) if seconds else args.chunk_seconds))
    if args.before is not None:
        servers.append(("before", args.before.resolve(), "", args.chunk_seconds))
    print(f"model {model}; long {args.long} tokens, short {args.short}, {args.tokens} tokens each; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        for label, root, order, seconds in servers:
            server = serve_private(config_text(model, order, seconds), Path(tmp) / label, root=root)
            try:
                asyncio.run(timed(server.base, text_of(tokenizer, "warm up", 64), 4))  # first-use costs
                started = time.perf_counter()
                rounds = [asyncio.run(one_round(server.base, tokenizer, args, r)) for r in range(args.rounds)]
                results.append(summary(label, rounds, time.perf_counter() - started))
            finally:
                server.close()
            print(f"[{label}] {args.rounds} rounds in {results[-1]['wall_s']:.1f} s; "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print("whole run (all rounds of each server, first send to last token):")
    for res in results:
        print(f"  {res['label']:<12} {res['wall_s']:8.1f} s")
    print("per kind (medians over rounds):")
    for res in results:
        short_ok = "ok" if res["short_ratio"] <= 2.0 else "MISSED"
        long_ok = "ok" if res["long_ratio"] <= 1.25 else "MISSED"
        print(f"  {res['label']:<12} short TTFT alone {res['short_ttft_alone_s']:.3f} s, with the long one running "
              f"{res['short_ttft_together_s']:.3f} s: {res['short_ratio']:.2f}x (goal <= 2x: {short_ok}); "
              f"long total alone {res['long_total_alone_s']:.2f} s, together {res['long_total_together_s']:.2f} s: "
              f"{res['long_ratio']:.2f}x (goal <= 1.25x: {long_ok})")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
