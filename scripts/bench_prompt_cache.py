"""Prompt cache (SPEC H1-H3): a growing chat's time to first token with and without it,
and a mixed workload whose cache bytes must stay under a small budget.

    python scripts/bench_prompt_cache.py [--size 8MiB] [--turns 10] [--requests 200]

One run starts two supervisors (`python -m supervisor serve`, the real HTTP
front door, a worker process each) on the same generated model: one with
`[guard] hot_cache_max = 1GiB`, one with `hot_cache_max = 0`.

1. Chat: a ~1,700-token system prompt, then `--turns` turns; each adds a user
   message and the assistant's reply (~100 tokens together) to the history.
   The model is small (8 MiB of float32 weights by default) because MLX's CPU
   prefill on the 2-core CI-class machine takes 1-2 s per 512-token chunk
   even so; a bigger model would spend more than the heartbeat timeout in one
   step and be killed as wedged.
   Both supervisors get the same history every turn (the reply of the cached
   one is fed back to both), turns alternate between them so machine drift
   hits both alike, and TTFT is request sent -> first streamed token.
2. Mixed workload: `--requests` completions over two small models, four at a
   time, prompts drawn from a few shared prefixes with random tails, under a
   small budget (`--budget`, default 4 MiB), on a third supervisor. The
   shared-memory ledger, where every worker writes its cache bytes at every
   step, is read every millisecond or so; the maximum of the group's sum is
   printed against the budget.

The last line is the headline:

    prompt cache: turn-10 TTFT X ms vs Y ms without (Z×)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import format_size, parse_size  # noqa: E402

WORDS = ("memory pressure guard worker model cache prefix token budget ceiling supervisor "
         "allocator process prefill decode stream sample ledger policy tier reserve").split()


# The generated tokenizer spends ~2.2 tokens on each of these words.
SYSTEM_WORDS = 780   # ~1,700 tokens
USER_WORDS = 36      # ~80 tokens, plus a ~20-token reply: ~100 tokens a turn


def ensure_model(name: str, size: int, seed: int, dtype: str = "float32") -> Path:
    return bench_model(f"{name}-{size}-{dtype}-seed{seed}", size, seed, dtype)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Server(ServeProcess):
    """`python -m supervisor serve` in a subprocess, with its own config and runtime dir."""

    def __init__(self, workdir: Path, name: str, models: dict[str, Path], guard: str) -> None:
        # Pings are answered between engine steps, and on a busy 2-core machine one
        # 512-token prefill chunk can outlast the default 5 s heartbeat timeout.
        body = f"[guard]\n{guard}\n[supervisor]\nheartbeat_timeout = 120\n" + "".join(
            f'[[models]]\nid = "{mid}"\npath = "{path}"\npinned = true\nmax_concurrency = 4\n'
            for mid, path in models.items())
        super().__init__(body, config=workdir / f"{name}.toml", runtime=workdir / f"rt-{name}",
                         log=workdir / f"{name}.log", timeout=300.0, stop_grace=60.0)

    def chat(self, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
        """Streamed greedy chat: (TTFT seconds, reply text, usage)."""
        import httpx

        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        first, parts, usage = 0.0, [], {}
        with httpx.Client(timeout=600) as client:
            sent = time.perf_counter()
            with client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise SystemExit(f"{self.base}: HTTP {r.status_code}: {r.read().decode()}")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices", []):
                        if first == 0.0:
                            first = time.perf_counter()
                        parts.append(choice["delta"].get("content") or "")
        return first - sent, "".join(parts), usage

    def complete(self, client, model: str, prompt: str, max_tokens: int) -> dict:
        r = client.post(f"{self.base}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]

    def metric(self, client, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(client.get(f"{self.base}/metrics").text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        return 0.0


def chat_bench(cached: Server, plain: Server, turns: int, reply_tokens: int) -> list[tuple]:
    """Per turn: (TTFT with the cache, TTFT without, usage with the cache, same reply)."""
    rng = random.Random(10)
    messages = [{"role": "system", "content": text(rng, SYSTEM_WORDS)}]
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"turn {turn}: " + text(rng, USER_WORDS)})
        with_cache, reply, usage = cached.chat("chat", messages, reply_tokens)
        without, plain_reply, plain_usage = plain.chat("chat", messages, reply_tokens)
        rows.append((with_cache, without, usage, reply == plain_reply))
        print(f"turn {turn:>2}: prompt {usage.get('prompt_tokens', 0):>5} tokens "
              f"({usage.get('prompt_tokens_details', {}).get('cached_tokens', 0):>5} cached)  "
              f"TTFT {with_cache * 1000:8.1f} ms with the cache, {without * 1000:8.1f} ms without "
              f"({plain_usage.get('prompt_tokens_details', {}).get('cached_tokens', 0)} cached)", flush=True)
        messages.append({"role": "assistant", "content": reply})
    return rows


def mixed_bench(server: Server, requests: int, budget: int) -> tuple[float, int, float]:
    """200 completions over two models; returns (max cache bytes seen, hits, seconds)."""
    import httpx

    rng = random.Random(200)
    prefixes = [text(rng, n) for n in (30, 80, 150, 20)]
    jobs = [(rng.choice(("m1", "m2")), rng.choice(prefixes) + " " + text(rng, rng.randint(5, 60)),
             rng.randint(2, 12)) for _ in range(requests)]
    seen = {"max": 0, "hits": 0, "polls": 0}
    done = threading.Event()

    def poll() -> None:
        from shared.ledger import Ledger

        ledger = Ledger.attach(server.runtime / "ledger")
        try:
            while not done.is_set():
                samples = (ledger.read_sample(slot) for slot in range(ledger.n_slots))
                total = sum(s.memory.cache_bytes for s in samples if s is not None)
                seen["max"] = max(seen["max"], total)
                seen["polls"] += 1
                time.sleep(0.001)
        finally:
            ledger.close()

    def work(share: list) -> None:
        with httpx.Client(timeout=600) as client:
            for model, prompt, max_tokens in share:
                usage = server.complete(client, model, prompt, max_tokens)
                seen["hits"] += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0

    poller = threading.Thread(target=poll)
    poller.start()
    started = time.perf_counter()
    workers = [threading.Thread(target=work, args=(jobs[i::4],)) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - started
    done.set()
    poller.join()
    with httpx.Client(timeout=30) as client:  # /metrics agrees with the ledger at the end
        final = server.metric(client, "memvisor_prompt_cache_bytes")
    print(f"mixed workload: {seen['polls']} ledger reads; group cache at the end {format_size(int(final))} "
          f"(/metrics)")
    return seen["max"], seen["hits"], seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8MiB", help="the chat model's float32 weights")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--reply-tokens", type=int, default=20, help="assistant tokens per turn")
    parser.add_argument("--requests", type=int, default=200, help="mixed workload size (0: skip it)")
    parser.add_argument("--budget", default="4MiB", help="hot_cache_max of the mixed workload")
    parser.add_argument("--workdir", default="", help="keep configs and supervisor logs here")
    args = parser.parse_args(argv)
    chat_model = ensure_model("prompt-cache-chat", parse_size(args.size), seed=11)
    budget = parse_size(args.budget)
    with tempfile.TemporaryDirectory(prefix="bench-pc-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        cached = Server(work, "cached", {"chat": chat_model}, 'hot_cache_max = "1GiB"')
        plain = Server(work, "plain", {"chat": chat_model}, "hot_cache_max = 0")
        try:
            for server in (cached, plain):
                server.chat("chat", [{"role": "user", "content": "warm up"}], 2)
            rows = chat_bench(cached, plain, args.turns, args.reply_tokens)
        finally:
            cached.close()
            plain.close()
        mixed = None
        if args.requests:
            small = {f"m{seed - 11}": ensure_model("prompt-cache-small", 8 * 1024 ** 2, seed=seed)
                     for seed in (12, 13)}
            server = Server(work, "mixed", small, f"hot_cache_max = {budget}")
            try:
                mixed = mixed_bench(server, args.requests, budget)
            finally:
                server.close()
    if mixed is not None:
        peak, hits, seconds = mixed
        verdict = "never above" if peak <= budget else "ABOVE"
        print(f"mixed workload: {args.requests} requests over 2 models in {seconds:.1f} s, {hits} cache hits; "
              f"group cache max {format_size(int(peak))} ({int(peak)} B) seen, {verdict} the "
              f"{format_size(budget)} ({budget} B) budget")
    same = sum(row[3] for row in rows)
    print(f"greedy replies identical with and without the cache (H1): {same} of {len(rows)} turns")
    with_cache, without = rows[-1][:2]
    print("(one run on a shared machine: compare the ratio, not the absolute times)")
    print(f"prompt cache: turn-{len(rows)} TTFT {with_cache * 1000:.0f} ms vs {without * 1000:.0f} ms "
          f"without ({without / with_cache:.1f}×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
