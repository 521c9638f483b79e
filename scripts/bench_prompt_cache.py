"""Prompt cache (SPEC H1-H3): a growing chat's time to first token with and without it,
a mixed workload whose cache bytes must stay under a small budget, and the chat's
next turn after its model was unloaded or evicted, with and without the disk tier (H5).

    python scripts/bench_prompt_cache.py [--size 8MiB] [--turns 10] [--requests 200]
    python scripts/bench_prompt_cache.py --cases eviction [--size 8MiB]

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

3. Eviction (H5, docs/rules.md): a ~1,500-token
   system prompt and a first turn, on two more supervisors whose model is not
   pinned, both with the memory tier: one with the disk tier
   (`disk_cache_max = "auto"`, its own MEMVISOR_CACHE), one without
   (`disk_cache_max = 0`). The model is then unloaded on both, once by
   `POST /v1/models/chat/unload` and once by the guard under pressure (a
   custom ceiling that puts the group's usage at the hard watermark: P5/P6
   stop the idle model), and the next turn is asked. The model is loaded
   again first and answers a two-word request (the same load and first pass
   on both sides, which a shared machine makes noisy), so the TTFT is the prefill's:
   the disk tier reads the conversation's KV back, the other side prefills
   it all again. Printed per eviction: TTFT with and without, the prompt
   tokens cached (and from disk), whether the greedy replies are the same,
   and the bytes the disk tier wrote and read.

The last line is the headline of the last case run:

    prompt cache: turn-10 TTFT X ms vs Y ms without (Z×)
    disk tier: TTFT after an eviction X ms vs Y ms without (Z×) ...
"""

from __future__ import annotations

import argparse
import json
import os
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

from shared.probe import blas_plan as found  # noqa: E402
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

    def __init__(self, workdir: Path, name: str, models: dict[str, Path], guard: str, *, pinned: bool = True,
                 env: dict[str, str] | None = None) -> None:
        # Pings are answered between engine steps, and on a busy 2-core machine one
        # 512-token prefill chunk can outlast the default 5 s heartbeat timeout.
        body = f"[guard]\n{guard}\n[supervisor]\nheartbeat_timeout = 120\n" + "".join(
            f'[[models]]\nid = "{mid}"\npath = "{path}"\npinned = {str(pinned).lower()}\nmax_concurrency = 4\n'
            for mid, path in models.items())
        super().__init__(body, config=workdir / f"{name}.toml", runtime=workdir / f"rt-{name}",
                         log=workdir / f"{name}.log", timeout=300.0, stop_grace=60.0, env=env)

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


# -- 3. the next turn after an eviction, with and without the disk tier (H5) -----------------

EVICTION_SYSTEM_WORDS = 690  # ~1,500 tokens


def status(server: Server) -> dict:
    import httpx

    return httpx.get(f"{server.base}/status", timeout=30).json()


def model_state(server: Server, model: str) -> str:
    return next(m["state"] for m in status(server)["models"] if m["id"] == model)


def wait_for(what: str, predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def post(server: Server, path: str, body: dict | None = None) -> dict:
    import httpx

    r = httpx.post(f"{server.base}{path}", json=body, timeout=600) if body is not None else \
        httpx.post(f"{server.base}{path}", timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"{server.base}{path}: HTTP {r.status_code}: {r.text}")
    return r.json()


def unload(server: Server, model: str) -> None:
    post(server, f"/v1/models/{model}/unload")


def pressure_ceiling(guard: dict) -> int:
    """A custom ceiling whose soft watermark (0.90 on the custom tier) is 2 MiB over the supervisor's
    own usage: whatever P5's shrink and P4's reclaim give back, the worker keeps the group at the
    hard watermark, and P6 stops it (the idle, unpinned model)."""
    supervisor = guard["usage"] - sum(w["usage"] for w in guard["workers"])
    return int((supervisor + 2 * 1024 ** 2) / 0.90)


def evict_under_pressure(server: Server, model: str) -> None:
    """P6 at hard: a custom ceiling that the model's worker alone puts the group over; the guard
    stops the idle, unpinned model (after P5 shrank its cache); then the ceiling goes back."""
    post(server, "/admin/guard", {"tier": "custom", "custom_ceiling": pressure_ceiling(status(server)["guard"])})
    try:
        wait_for(f"the guard to stop {model}", lambda: model_state(server, model) == "unloaded", 60)
    finally:
        post(server, "/admin/guard", {"tier": "balanced", "custom_ceiling": 0})
    events = [e for e in status(server)["events"] if e["model_id"] == model and e["kind"] in ("evict", "shrink_cache")]
    print(f"  {server.base}: " + "; ".join(f"{e['kind']}: {e['reason']}" for e in events[-2:]), flush=True)


def disk_figures(server: Server) -> dict:
    return status(server)["disk_cache"]


def eviction_bench(disk: Server, plain: Server, reply_tokens: int) -> list[tuple]:
    """Per eviction: (how, TTFT with the disk tier, TTFT without, usage with, same reply, written, read)."""
    rng = random.Random(26)
    messages = [{"role": "system", "content": text(rng, EVICTION_SYSTEM_WORDS)},
                {"role": "user", "content": "turn 1: " + text(rng, USER_WORDS)}]
    _, reply, usage = disk.chat("chat", messages, reply_tokens)
    plain.chat("chat", messages, reply_tokens)
    print(f"turn 1: {usage.get('prompt_tokens', 0)} prompt tokens, cold on both", flush=True)
    rows = []
    for turn, (how, evict) in enumerate((("unload", unload), ("guard under pressure", evict_under_pressure)), 2):
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"turn {turn}: " + text(rng, USER_WORDS)}]
        before = disk_figures(disk)
        for server in (disk, plain):
            evict(server, "chat")
        wait_for("the disk tier's write to be reported",
                 lambda b=before: disk_figures(disk)["written_entries"] > b["written_entries"], 30)
        written = disk_figures(disk)["written_bytes"] - before["written_bytes"]
        for server in (disk, plain):  # the same load and first pass on both sides: the TTFT below is the prefill's
            post(server, "/v1/models/chat/load")
            server.chat("chat", [{"role": "user", "content": "warm up"}], 1)
        order = (disk, plain) if turn % 2 == 0 else (plain, disk)  # machine drift hits both alike
        results = {id(server): server.chat("chat", messages, reply_tokens) for server in order}
        (with_disk, reply, usage), (without, plain_reply, _) = results[id(disk)], results[id(plain)]
        wait_for("the read's report", lambda b=before: disk_figures(disk)["read_entries"] > b["read_entries"], 30)
        read = disk_figures(disk)["read_bytes"] - before["read_bytes"]
        details = usage.get("prompt_tokens_details", {})
        rows.append((how, with_disk, without, usage, reply == plain_reply, written, read))
        print(f"turn {turn} after {how}: prompt {usage.get('prompt_tokens', 0)} tokens "
              f"({details.get('cached_tokens', 0)} cached, {details.get('disk_cached_tokens', 0)} from disk)  "
              f"TTFT {with_disk * 1000:8.1f} ms with the disk tier, {without * 1000:8.1f} ms without "
              f"({without / with_disk:.1f}×); same reply: {reply == plain_reply}; disk wrote "
              f"{format_size(written)}, read {format_size(read)}", flush=True)
    return rows


def private_cache(work: Path) -> dict[str, str]:
    """An environment whose MEMVISOR_CACHE is a fresh private folder sharing the user's
    verified BLAS copy (hard links, made once)."""
    from worker import blas

    root = work / "cache-disk-tier"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    blas.preload()
    blas.share_copy(root)
    return {**os.environ, found.CACHE_ENV: str(root)}


def run_eviction(work: Path, chat_model: Path, reply_tokens: int) -> list[tuple]:
    memory = 'hot_cache_max = "1GiB"\n'
    disk = Server(work, "disk-tier", {"chat": chat_model}, memory + 'disk_cache_max = "auto"', pinned=False,
                  env=private_cache(work))
    plain = Server(work, "no-disk-tier", {"chat": chat_model}, memory + "disk_cache_max = 0", pinned=False)
    try:
        return eviction_bench(disk, plain, reply_tokens)
    finally:
        disk.close()
        plain.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8MiB", help="the chat model's float32 weights")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--reply-tokens", type=int, default=20, help="assistant tokens per turn")
    parser.add_argument("--requests", type=int, default=200, help="mixed workload size (0: skip it)")
    parser.add_argument("--budget", default="4MiB", help="hot_cache_max of the mixed workload")
    parser.add_argument("--workdir", default="", help="keep configs and supervisor logs here")
    parser.add_argument("--cases", default="chat,mixed,eviction",
                        help="which cases to run, comma-separated: chat, mixed, eviction")
    args = parser.parse_args(argv)
    cases = set(args.cases.split(","))
    chat_model = ensure_model("prompt-cache-chat", parse_size(args.size), seed=11)
    budget = parse_size(args.budget)
    rows: list[tuple] = []
    evictions: list[tuple] = []
    with tempfile.TemporaryDirectory(prefix="bench-pc-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "chat" in cases:
            cached = Server(work, "cached", {"chat": chat_model}, 'hot_cache_max = "1GiB"')
            plain = Server(work, "plain", {"chat": chat_model}, "hot_cache_max = 0")
            try:
                for server in (cached, plain):
                    server.chat("chat", [{"role": "user", "content": "warm up"}], 2)
                rows = chat_bench(cached, plain, args.turns, args.reply_tokens)
            finally:
                cached.close()
                plain.close()
        if "eviction" in cases:
            evictions = run_eviction(work, chat_model, args.reply_tokens)
        mixed = None
        if args.requests and "mixed" in cases:
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
    print("(one run on a shared machine: compare the ratio, not the absolute times)")
    if rows:
        same = sum(row[3] for row in rows)
        print(f"greedy replies identical with and without the cache (H1): {same} of {len(rows)} turns")
        with_cache, without = rows[-1][:2]
        print(f"prompt cache: turn-{len(rows)} TTFT {with_cache * 1000:.0f} ms vs {without * 1000:.0f} ms "
              f"without ({without / with_cache:.1f}×)")
    if evictions:
        for how, with_disk, without, _usage, same_reply, written, read in evictions:
            print(f"disk tier after {how}: TTFT {with_disk * 1000:.0f} ms vs {without * 1000:.0f} ms without "
                  f"({without / with_disk:.1f}×), same greedy reply: {same_reply}; "
                  f"wrote {format_size(written)}, read {format_size(read)}")
        worst = min(without / with_disk for _how, with_disk, without, *_ in evictions)
        same = sum(row[4] for row in evictions)
        print(f"disk tier: TTFT after an eviction at least {worst:.1f}× faster than without "
              f"({len(evictions)} evictions: unload, guard), same greedy reply {same} of {len(evictions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
