"""Batched decode through the front door: concurrent streams vs one at a time.

    python scripts/bench_batch.py [--model DIR | --size 100MB --dtype float32]
                                  [--streams 1,4,8] [--tokens 64] [--runs 3]

One `python -m supervisor serve` in a subprocess with one pinned model
(`max_concurrency` raised to the largest stream count), one worker. For each
stream count N, in the same run:

- concurrent: N streamed `/v1/completions` requests (greedy, different
  prompts) sent at once; the worker decodes them as one batch;
- sequential: the same N requests, one after the other.

Aggregate decode tokens/s = tokens streamed / wall time (request sent ->
last token), so prefill is in both sides alike. The supervisor's CPU
(psutil user + system of its pid, not its worker's) is divided by the tokens
it streamed: the goal is <= 150 us per token at 8 streams. Its idle CPU (the
guard's ticks, which run whatever the traffic) is measured first and printed
too, with the per-token figure net of it, since on a slow model the idle
ticks are a large share of each token's CPU.

A small model (`--size 4MB`) decodes faster than the supervisor can stream,
which is the regime where its per-token CPU decides the throughput (a GPU
worker's regime). `--model DIR` runs any local MLX model folder (e.g. on an
H200: `--model DIR --streams 1,8,32`). Figures on a shared 2-core machine
are noisy; compare the ratios within one run. Last line:

    batch decode @N: X tok/s vs Y tok/s sequential (Z×)

`--peers` runs scripts/bench_peers.py instead: in one run the raw
in-process batched loop, `stream_generate`, memvisor and `mlx_lm.server`
by the team's reference streaming client, TTFT and peak memory per server
(see that file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, add_model_args, model_from_args  # noqa: E402  (scripts/ is on sys.path as the script's folder)

TOPICS = ["the weather", "a ship at sea", "memory and machines", "an old library", "the city at night",
          "a garden", "mountains", "the first computer", "a long train ride", "the river"]


def prompt(i: int) -> str:
    return f"Story {i}: once upon a time, {TOPICS[i % len(TOPICS)]}"


class Server(ServeProcess):
    """`serve` with one pinned model and room for `concurrency` streams."""

    def __init__(self, model: Path, workdir: Path, concurrency: int) -> None:
        import psutil

        super().__init__(f'[[models]]\nid = "bench"\npath = "{model}"\npinned = true\n'
                         f"max_concurrency = {concurrency}\n",
                         config=workdir / "bench.toml", runtime=workdir / "rt", log=workdir / "serve.log",
                         timeout=300.0)
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        times = self.ps.cpu_times()
        return times.user + times.system


async def one_stream(client, base: str, i: int, tokens: int) -> int:
    body = {"model": "bench", "prompt": prompt(i), "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    count = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                count = json.loads(line[6:])["usage"]["completion_tokens"]
    return count


class Result:
    def __init__(self, tokens: int, seconds: float, cpu: float) -> None:
        self.tokens, self.seconds, self.cpu = tokens, seconds, cpu

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @staticmethod
    def median(runs: list["Result"]) -> "Result":
        """The run of median throughput (its CPU and tokens come with it)."""
        return sorted(runs, key=lambda r: r.tps)[len(runs) // 2]


async def measure(server: Server, n: int, tokens: int, concurrent: bool) -> Result:
    import httpx

    limits = httpx.Limits(max_connections=max(n, 1) + 4, max_keepalive_connections=max(n, 1) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        cpu0, t0 = server.cpu(), time.perf_counter()
        if concurrent:
            counts = await asyncio.gather(*(one_stream(client, server.base, i, tokens) for i in range(n)))
        else:
            counts = [await one_stream(client, server.base, i, tokens) for i in range(n)]
        seconds = time.perf_counter() - t0
        return Result(sum(counts), seconds, server.cpu() - cpu0)


def idle_cpu_rate(server: Server, seconds: float = 10.0) -> float:
    """Supervisor CPU seconds per second with no traffic (guard ticks, heartbeats); over 10 s,
    since the OS counts CPU time in 10 ms ticks."""
    cpu0, t0 = server.cpu(), time.perf_counter()
    time.sleep(seconds)
    return (server.cpu() - cpu0) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--peers" in argv:  # raw batched loop, memvisor and mlx_lm.server side by side
        from bench_peers import main as peers

        return peers([a for a in argv if a != "--peers"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, size="100MB", streams="1,4,8")
    parser.add_argument("--runs", type=int, default=3, help="rounds per stream count (median kept)")
    args = parser.parse_args(argv)
    try:
        counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    except ValueError:
        parser.error(f"--streams: comma-separated integers, got {args.streams!r}")
    if not counts or counts[0] < 1:
        parser.error("--streams: at least one count, each >= 1")
    model = model_from_args(args, "batch")
    results: dict[int, tuple[Result, Result]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        server = Server(model, Path(tmp), max(counts))
        try:
            asyncio.run(measure(server, 2, 8, concurrent=True))  # warm-up: compile, connections
            idle = idle_cpu_rate(server)
            for n in counts:
                # rounds alternate the two sides, so drift hits both alike; medians are kept
                pairs = [(asyncio.run(measure(server, n, args.tokens, concurrent=False)),
                          asyncio.run(measure(server, n, args.tokens, concurrent=True)))
                         for _ in range(args.runs)]
                seq, con = (Result.median([pair[k] for pair in pairs]) for k in (0, 1))
                results[n] = seq, con
                net = max(0.0, con.cpu - idle * con.seconds)
                print(f"{n:>3} streams: {con.tps:8.1f} tok/s concurrent, {seq.tps:8.1f} tok/s sequential "
                      f"({con.tps / seq.tps if seq.tps else 0:.2f}x); supervisor CPU per token "
                      f"{con.cpu / max(1, con.tokens) * 1e6:.0f} us ({net / max(1, con.tokens) * 1e6:.0f} us "
                      f"net of idle), sequential {seq.cpu / max(1, seq.tokens) * 1e6:.0f} us", flush=True)
        finally:
            server.close()
    print(f"model: {model}; {args.tokens} max tokens per stream; supervisor idle CPU "
          f"{idle * 1000:.1f} ms/s")
    top = max(counts)
    seq, con = results[top]
    print(f"batch decode @{top}: {con.tps:.1f} tok/s vs {seq.tps:.1f} tok/s sequential "
          f"({con.tps / seq.tps if seq.tps else 0:.2f}×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
