"""Shrink before drop (H6 as proposed): what quantizing a prompt-cache entry returns, and what
reusing it does to the greedy reply.

    python scripts/bench_kv_quant.py [--sizes 8MiB] [--model DIR ...] [--chats 10] [--reply-tokens 32]

Generated models (`--sizes`) have random weights, and their greedy replies
mostly repeat one token, which says little about quantization; `--model`
takes a real one, e.g. SmolLM2-135M-Instruct dequantized to float32 (MLX's
CPU quantized matmul is not BLAS, and ~100x slower here):

    python -m supervisor import-gguf SmolLM2-135M-Instruct.Q4_1.gguf smollm2-q4
    python -m mlx_lm convert --hf-path smollm2-q4 --mlx-path smollm2-f32 -d --dtype float32
    python scripts/bench_kv_quant.py --sizes "" --model smollm2-f32 --chats 6 --system-words 200

For each model and each of `--chats` conversations (a system prompt of
`--system-words` words, ~1,500 tokens by default, and a user turn, different
words each), in one process with the worker's own engine:

1. the first turn runs cold; its KV (prompt and reply) is kept as the prompt
   cache's entry, as a worker keeps it;
2. the second turn (the history plus a new user message) is asked three ways:
   reusing that entry as it is (float: the reply H1 guarantees, identical to a
   prefill from scratch), and reusing it after quantizing it to 8 and to 4 bits
   (`PromptCache.quantize_unused`, what a worker does at soft pressure).

Printed per model and bits: the bytes the entry held and what quantizing
returned, how many of the greedy replies are token-identical to the float
reuse, and where the others first differ (token index). The last line is the
headline.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import format_size, parse_size  # noqa: E402
from worker import blas  # noqa: E402

WORDS = ("memory pressure guard worker model cache prefix token budget ceiling supervisor "
         "allocator process prefill decode stream sample ledger policy tier reserve").split()
SYSTEM_WORDS = 690  # ~1,500 tokens with the generated tokenizer
USER_WORDS = 36


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token that differs (len when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8MiB", help="float32 weight sizes of generated models (\"\": none)")
    parser.add_argument("--model", action="append", default=[], help="a model folder (repeatable)")
    parser.add_argument("--system-words", type=int, default=SYSTEM_WORDS)
    parser.add_argument("--chats", type=int, default=10)
    parser.add_argument("--reply-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    blas.preload()
    import mlx_lm

    from shared.limits import Limits
    from shared.protocol import ChatMessage, Finished, Generate, TokenOut
    from worker.engine import Engine

    limits = Limits(max_concurrency=4, cache_cap=1 << 34)

    def ask(engine: Engine, messages: list[ChatMessage], rid: str) -> tuple[list[int], str, Finished]:
        engine.step(limits, lambda: 0)
        engine.submit_generate(Generate(request_id=rid, messages=messages, max_tokens=args.reply_tokens))
        tokens: list[int] = []
        parts: list[str] = []
        end: Finished | None = None
        while engine.has_work:
            for ev in engine.step(limits, lambda: 0):
                if isinstance(ev, TokenOut):
                    tokens.append(ev.token_id)
                    parts.append(ev.text)
                elif isinstance(ev, Finished):
                    end = ev
        assert end is not None, "the request failed"
        return tokens, "".join(parts), end

    headline = []
    paths = [bench_model(f"kv-quant-{size}-float32", parse_size(size), 7, "float32")
             for size in args.sizes.split(",") if size] + [Path(m) for m in args.model]
    for path in paths:
        model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(path)))
        results: dict[int, list[tuple[bool, int, int, int]]] = {8: [], 4: []}
        distinct: set[int] = set()
        for chat in range(args.chats):
            rng = random.Random(100 + chat)
            history = [ChatMessage(role="system", content=text(rng, args.system_words)),
                       ChatMessage(role="user", content="turn 1: " + text(rng, USER_WORDS))]
            follow = ChatMessage(role="user", content="turn 2: " + text(rng, USER_WORDS))
            replies: dict[int, list[int]] = {}
            for bits in (0, 8, 4):
                engine = Engine(model, tokenizer, own_usage_fn=lambda: 0)
                _, first_text, _ = ask(engine, history, "t1")
                held = engine.cache_bytes
                count, returned = engine.quantize_cache(bits) if bits else (0, 0)
                assert not bits or count == 1, "the entry was not quantized"
                messages = [*history, ChatMessage(role="assistant", content=first_text), follow]
                tokens, _, end = ask(engine, messages, "t2")
                assert end.cached_tokens > 0, "turn 2 did not reuse turn 1's entry"
                replies[bits] = tokens
                if bits:
                    results[bits].append((tokens == replies[0], first_difference(tokens, replies[0]), held, returned))
            distinct.add(len(set(replies[0])))
        print(f"model {path.name}; distinct tokens per float reply: "
              f"{min(distinct)}-{max(distinct)} of {args.reply_tokens}")
        for bits, rows in results.items():
            identical = sum(1 for r in rows if r[0])
            entry = sum(r[2] for r in rows) / len(rows)
            freed = sum(r[3] for r in rows) / len(rows)
            diffs = sorted(r[1] for r in rows if not r[0])
            where = f"; the others first differ at token {', '.join(map(str, diffs))}" if diffs else ""
            print(f"  {bits}-bit: entry {format_size(int(entry))}, quantizing returned {format_size(int(freed))} "
                  f"({freed / entry:.0%}); greedy reply identical to the float reuse in {identical} of "
                  f"{len(rows)} chats{where}", flush=True)
            headline.append(f"{path.name} {bits}-bit {identical}/{len(rows)} identical, {freed / entry:.0%} returned")
    print("shrink before drop: " + "; ".join(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
