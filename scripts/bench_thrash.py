"""Two models that fit only one at a time, a client alternating between them: swaps and failures (SPEC W5).

Issue 31's benchmark, part d. Two generated 300 MiB models (`scripts/make_model.py
--size 300MiB --dtype float32`) under a custom ceiling sized, from the usage
measured with one of them loaded, to hold only one. float32, not the
generator's float16: MLX on a CPU computes float16 about 10x slower (8 tokens
on this 2-core machine: 8.3 s in float16, 0.7 s in float32), and a request
many times longer than a swap is not the case a hold is for (a GPU is fast
at both).
A client sends 20 requests that alternate between them (a, b, a, b, ...),
with a concurrency of 4: a work queue that 4 callers take the next request
from as soon as their last one is answered, as an evaluation harness or an
agent's parallel sub-calls do. A sequential client would gain nothing from
a hold: when it asks for b, a has nothing left to serve (docs/thrash-and-prefetch.md).

The same client runs against a fresh `python -m supervisor serve` for each
configuration, in one run:

  * `off`: `[guard] thrash_hold = 0`, admission as it was before W5;
  * `hand-over`: W5 with `thrash_swaps` so high that thrash is never found:
    a load waits for the model in its way to finish its requests (closing it
    to new ones at once), but never holds it open;
  * `on`: W5 as configured by default (thrash after 3 swaps, holds of 2 s).

For each: the whole run's time, the swaps (loads that stopped the other
model, `/status` counters), the requests that failed (any answer but 200),
and the thrash episodes. Goal: with W5, at least 3x fewer swaps than
requests, and no request failed. The whole run's figures are printed first
(progress lines go to stderr).

    python scripts/bench_thrash.py [--requests 20] [--concurrency 4] [--size 300MiB] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from _serve import ServeProcess, bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import format_size, parse_size  # noqa: E402

SOFT, HARD = 0.97, 0.99  # thresholds close to 1: the ceiling is sized in MiB above one model's usage
MODELS = ("a", "b")
CONFIGS = {  # name -> the [guard] lines that make it
    "off": "thrash_hold = 0",
    "hand-over": "thrash_swaps = 1000",
    "on": "",
}


@dataclass
class Run:
    name: str
    seconds: float
    swaps: int
    failed: dict[str, int]
    thrash_episodes: int
    thrash_events: list[str]  # those still in /status's recent events
    requests: int
    # before the first thrash event, and after it: (requests answered, swaps)
    before_thrash: tuple[int, int] = (0, 0)
    after_thrash: tuple[int, int] = (0, 0)

    @property
    def n_failed(self) -> int:
        return sum(self.failed.values())


def config_text(paths: dict[str, Path], guard: str) -> str:
    models = "".join(f'[[models]]\nid = "{m}"\npath = "{paths[m]}"\n\n' for m in MODELS)
    return (f"[guard]\ntier = \"custom\"\nsoft_threshold = {SOFT}\nhard_threshold = {HARD}\n"
            # no disk tier: a stop would write the prompt cache for up to 2 s and the swaps would measure that
            f"disk_cache_max = 0\n{guard}\n\n"
            f"[supervisor]\nheartbeat_timeout = 60.0\n\n{models}")


async def ceiling_for_one(http: httpx.AsyncClient, size: int) -> int:
    """With model a loaded: a ceiling whose soft target holds a but not a and b."""
    r = await http.post("/v1/models/a/load", timeout=300)
    r.raise_for_status()
    await asyncio.sleep(1.0)  # a sample after the load settles
    usage = (await http.get("/status")).json()["guard"]["usage"]
    ceiling = int((usage + size // 2) / SOFT)
    r = await http.post("/admin/guard", json={"tier": "custom", "custom_ceiling": ceiling})
    r.raise_for_status()
    return ceiling


async def client(http: httpx.AsyncClient, requests: int, concurrency: int,
                 answered: list[float]) -> dict[str, int]:
    """`requests` completions alternating a, b, a, ..., taken from one queue by `concurrency`
    callers; the time each is answered goes to `answered`."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(MODELS[i % 2])
    failed: dict[str, int] = {}

    def fail(why: str) -> None:
        failed[why] = failed.get(why, 0) + 1

    async def caller() -> None:
        while not queue.empty():
            model = queue.get_nowait()
            try:
                r = await http.post("/v1/completions", json={"model": model, "prompt": "the sea is", "max_tokens": 8},
                                    timeout=300)
            except httpx.HTTPError as exc:
                fail(type(exc).__name__)
                continue
            answered.append(time.monotonic())
            if r.status_code != 200:
                json_body = r.headers.get("content-type", "").startswith("application/json")
                fail(f"{r.status_code} {r.json().get('error', {}).get('code', '') if json_body else ''}")

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return failed


async def watch(http: httpx.AsyncClient, seen: list[tuple[float, int, int]], done: asyncio.Event) -> None:
    """(time, swaps, thrash episodes) from `/status` every 0.2 s, until `done`."""
    while not done.is_set():
        counters = (await http.get("/status")).json()["counters"]
        seen.append((time.monotonic(), counters.get("swaps", 0), counters.get("thrash_episodes", 0)))
        try:
            await asyncio.wait_for(done.wait(), 0.2)
        except asyncio.TimeoutError:
            pass


def split(seen: list[tuple[float, int, int]], answered: list[float]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(requests, swaps) before the first thrash episode was seen, and after it."""
    first, last = seen[0], seen[-1]
    found = next((x for x in seen if x[2] > first[2]), None)
    if found is None:
        return (len(answered), last[1] - first[1]), (0, 0)
    t, swaps = found[0], found[1] - first[1]
    early = sum(1 for a in answered if a <= t)
    return (early, swaps), (len(answered) - early, last[1] - first[1] - swaps)


async def measure(name: str, base: str, size: int, requests: int, concurrency: int) -> Run:
    async with httpx.AsyncClient(base_url=base) as http:
        ceiling = await ceiling_for_one(http, size)
        seen: list[tuple[float, int, int]] = []
        answered: list[float] = []
        done = asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(watch(http, seen, done))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        failed = await client(http, requests, concurrency, answered)
        seconds = time.monotonic() - started
        done.set()
        await watcher
        after = (await http.get("/status")).json()
    counters = after["counters"]
    seen.append((time.monotonic(), counters.get("swaps", 0), counters.get("thrash_episodes", 0)))
    before_thrash, after_thrash = split(seen, answered)
    thrash = [e["reason"] for e in after["events"] if e["kind"] == "thrash"]
    print(f"  {name}: ceiling {format_size(ceiling)}, {seconds:.1f} s", file=sys.stderr, flush=True)
    return Run(name, seconds, seen[-1][1] - seen[0][1], failed, seen[-1][2] - seen[0][2], thrash, requests,
               before_thrash, after_thrash)


def run_config(name: str, paths: dict[str, Path], size: int, requests: int, concurrency: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-thrash-") as tmp:
        root = Path(tmp)
        serve = ServeProcess(config_text(paths, CONFIGS[name]), config=root / "config.toml", runtime=root / "rt",
                             log=root / "serve.log", timeout=120)
        try:
            return asyncio.run(measure(name, serve.base, size, requests, concurrency))
        finally:
            serve.close()


def report(runs: list[Run], requests: int, concurrency: int) -> None:
    print(f"{requests} requests alternating a, b (concurrency {concurrency}); two models, a ceiling for one")
    print(f"{'config':10s} {'total':>8s} {'swaps':>6s} {'req/swap':>9s} {'failed':>7s}  {'thrash':>6s}  "
          "req/swap before thrash | after")
    for r in runs:
        print(f"{r.name:10s} {r.seconds:7.1f}s {r.swaps:6d} {per_swap(r.requests, r.swaps):>9s} {r.n_failed:7d}  "
              f"{r.thrash_episodes:6d}  {per_swap(*r.before_thrash):>8s} ({r.before_thrash[0]}/{r.before_thrash[1]})"
              f" | {per_swap(*r.after_thrash)} ({r.after_thrash[0]}/{r.after_thrash[1]})"
              + (f"   failures: {r.failed}" if r.failed else ""))
    on = next(r for r in runs if r.name == "on")
    ratio = on.requests / on.swaps if on.swaps else float("inf")
    verdict = "PASS" if ratio >= 3 and on.n_failed == 0 else "FAIL"
    print(f"\ngoal (W5 on): >= 3x fewer swaps than requests, none failed: {ratio:.1f}x, {on.n_failed} failed: {verdict}")
    for reason in on.thrash_events:
        print(f"  thrash: {reason}")


def per_swap(requests: int, swaps: int) -> str:
    return f"{requests / swaps:.1f}" if swaps else "-"


def run_all(*, size: int, dtype: str, requests: int, concurrency: int, names: list[str]) -> list[Run]:
    """Each configuration's run against a fresh supervisor, then the whole run's figures printed."""
    paths = {m: bench_model(f"thrash-{size}-s{21 + i}-{dtype}", size, 21 + i, dtype) for i, m in enumerate(MODELS)}
    runs = [run_config(name, paths, size, requests, concurrency) for name in names]
    report(runs, requests, concurrency)
    return runs


def part_d(workdir: Path | None = None) -> None:
    """Issue 31's part (d) with the defaults, for scripts/bench_swap.py (its work folder is not
    needed: each supervisor runs in a temporary folder, the models are the benchmarks' cache)."""
    print("(d) thrash: two 300 MiB float32 models, a ceiling for one, 20 requests alternating, 4 callers")
    run_all(size=parse_size("300MiB"), dtype="float32", requests=20, concurrency=4, names=list(CONFIGS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--size", default="300MiB", help="weights of each generated model (default 300MiB)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"which to run (default {','.join(CONFIGS)})")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    if "on" not in names or any(n not in CONFIGS for n in names):
        raise SystemExit(f"--configs: choose among {', '.join(CONFIGS)}, 'on' included")
    runs = run_all(size=parse_size(args.size), dtype=args.dtype, requests=args.requests,
                   concurrency=args.concurrency, names=names)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=1))


if __name__ == "__main__":
    main()
