"""The engine side by side (issue 22): the raw batched loop, memvisor and mlx-lm's own server.

    python scripts/bench_batch.py --peers [--model DIR | --size 4MB --dtype float32]
                                      [--streams 1,8] [--tokens 64] [--skip-mlx-server]
    (or python scripts/bench_peers.py with the same flags)

One run, one model, in this order:

- **stream_generate**: mlx-lm's in-process `stream_generate`, one stream;
  its own `generation_tps` (decode only) is the one-stream ceiling.
- **raw**: an in-process batched decode loop (the ceiling at N streams): N
  prompts of equal length prefilled as one batch in a plain `KVCache`, then
  one forward pass per step with mlx-lm's one-ahead pipelining; tok/s =
  N x tokens / decode time.
- **memvisor**: `python -m supervisor serve` with the model pinned
  (`max_concurrency` = the largest N), N streamed `/v1/completions` sent at once.
- **mlx_lm.server**: `python -m mlx_lm.server --decode-concurrency N`, run
  through a two-line wrapper that raises `ThreadingHTTPServer.request_queue_size`
  to 1024 (its default of 5 pending connections refuses simultaneous arrivals).

Both servers get the same streaming client: aggregate tok/s = tokens / (last
token - send), TTFT min/median/max over N simultaneous arrivals, one-stream
decode tok/s = (tokens - 1) / (last token - first token), and the peak RSS
of the server's processes (supervisor + worker; sampled every 50 ms). The
server runs are preceded by a warm-up. Figures on a shared CPU are noisy:
compare the ratios printed at the end, within one run. Each side runs
`--runs` rounds and keeps its best (as timeit does), peak RSS over all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import parse_size  # noqa: E402

MLX_SERVER = ("import sys, http.server; http.server.ThreadingHTTPServer.request_queue_size = 1024; "
              "import mlx_lm.server; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; mlx_lm.server.main()")


def prompt(i: int) -> str:
    return f"Story {i % 10}: once upon a time, in a small town by the sea"


# ------------------------------------------------------------------ in-process ceilings


def stream_generate_tps(model_dir: Path, tokens: int, runs: int) -> float:
    import mlx_lm

    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(model_dir)))  # no config asked for
    best = 0.0
    for _ in range(runs + 1):  # the first run compiles; the best of the rest is kept
        last = None
        for response in mlx_lm.stream_generate(model, tokenizer, prompt(0), max_tokens=tokens):
            last = response
        if last is not None:
            best = max(best, last.generation_tps)
    return best


def raw_batched_tps(model_dir: Path, streams: int, tokens: int, runs: int) -> float:
    """One forward pass per step for `streams` rows of equal length, pipelined one ahead."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(model_dir)))  # no config asked for
    ids = tokenizer.encode(prompt(0))
    rate = 0.0
    for _ in range(runs + 1):
        cache = make_prompt_cache(model)
        batch = mx.array([ids] * streams)
        logits = model(batch, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1)
        mx.eval(y)
        started = time.perf_counter()
        for _ in range(tokens):
            following = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(following)
            y.tolist()
            y = following
        y.tolist()
        rate = max(rate, streams * tokens / (time.perf_counter() - started))
    return rate


# ------------------------------------------------------------------ the servers


class Peak:
    """The largest RSS of a process and its children, sampled every 50 ms on a thread."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.bytes = max(self.bytes, self._sample())

    def __enter__(self) -> "Peak":
        self.bytes = self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop.clear()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Stream:
    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first = 0.0
        self.last = 0.0
        self.chunks = 0
        self.tokens = 0


async def one_stream(client, url: str, model: str, i: int, tokens: int) -> Stream:
    body = {"model": model, "prompt": prompt(i), "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    s = Stream()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                s.tokens = event["usage"].get("completion_tokens", 0)
            if event.get("choices") and event["choices"][0].get("text"):
                now = time.perf_counter()
                s.first = s.first or now
                s.last = now
                s.chunks += 1
    s.tokens = s.tokens or s.chunks
    return s


async def round_of(url: str, model: str, n: int, tokens: int) -> list[Stream]:
    import httpx

    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(one_stream(client, url, model, i, tokens) for i in range(n))))


class Figures:
    def __init__(self, streams: list[Stream], peak: int) -> None:
        start = min(s.sent for s in streams)
        end = max(s.last for s in streams)
        self.tokens = sum(s.tokens for s in streams)
        self.tps = self.tokens / (end - start) if end > start else 0.0
        ttft = sorted(s.first - s.sent for s in streams)
        self.ttft = (ttft[0], statistics.median(ttft), ttft[-1])
        one = streams[0]
        self.decode = (one.tokens - 1) / (one.last - one.first) if one.last > one.first else 0.0
        self.peak = peak

    def line(self, name: str, n: int) -> str:
        lo, mid, hi = self.ttft
        return (f"{name:>14} @{n:<3} {self.tps:8.1f} tok/s  TTFT min/med/max {lo * 1000:6.0f}/{mid * 1000:6.0f}/"
                f"{hi * 1000:6.0f} ms  one-stream decode {self.decode:7.1f} tok/s  peak RSS "
                f"{self.peak / 2**20:7.1f} MiB")


def run_server(url: str, model: str, pid: int, counts: list[int], tokens: int, runs: int) -> dict[int, Figures]:
    """Per stream count, the round of best throughput out of `runs` (as timeit: the least disturbed)."""
    asyncio.run(round_of(url, model, 2, 8))  # warm-up: compile, connections
    out = {}
    for n in counts:
        rounds = []
        for _ in range(runs):
            with Peak(pid) as peak:
                streams = asyncio.run(round_of(url, model, n, tokens))
            rounds.append(Figures(streams, peak.bytes))
        out[n] = max(rounds, key=lambda f: f.tps)
        out[n].peak = max(f.peak for f in rounds)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_server(model_dir: Path, n: int, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", MLX_SERVER, "--model", str(model_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--decode-concurrency", str(n), "--prompt-concurrency", str(n)],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlx_lm.server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"mlx_lm.server did not answer in 120 s; see {log}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a local MLX model folder (default: a generated one)")
    parser.add_argument("--size", default="4MB", help="weights of the generated model (default 4MB)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--streams", default="1,8", help="comma-separated stream counts (default 1,8)")
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per stream (default 64)")
    parser.add_argument("--skip-mlx-server", action="store_true", help="leave out mlx_lm.server")
    parser.add_argument("--runs", type=int, default=3, help="rounds per side and stream count, best kept")
    args = parser.parse_args(argv)
    counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    if not counts or counts[0] < 1:
        parser.error("--streams: at least one count, each >= 1")
    model = args.model or bench_model(f"engine-{parse_size(args.size)}-{args.dtype}", parse_size(args.size),
                                      11, args.dtype)
    single = stream_generate_tps(model, args.tokens, args.runs)
    print(f"{'stream_generate':>14} @1   {single:8.1f} tok/s (decode, in process)", flush=True)
    raw = {n: raw_batched_tps(model, n, args.tokens, args.runs) for n in counts}
    for n in counts:
        print(f"{'raw batched':>14} @{n:<3} {raw[n]:8.1f} tok/s (decode, in process)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        work = Path(tmp)
        server = ServeProcess(f'[[models]]\nid = "bench"\npath = "{model}"\npinned = true\n'
                              f"max_concurrency = {max(counts)}\n", config=work / "bench.toml",
                              runtime=work / "rt", log=work / "serve.log", timeout=300.0)
        try:
            ours = run_server(f"{server.base}/v1/completions", "bench", server.proc.pid, counts, args.tokens,
                              args.runs)
        finally:
            server.close()
        for n in counts:
            print(ours[n].line("memvisor", n), flush=True)
        theirs: dict[int, Figures] = {}
        if not args.skip_mlx_server:
            for n in counts:
                proc, base = mlx_server(model, n, work / f"mlx-{n}.log")
                try:
                    theirs[n] = run_server(f"{base}/v1/completions", str(model), proc.pid, [n], args.tokens,
                                           args.runs)[n]
                finally:
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                print(theirs[n].line("mlx_lm.server", n), flush=True)
    print(f"model: {model}; {args.tokens} max tokens per stream")
    if 1 in ours:
        print(f"memvisor one stream: {ours[1].decode / single:.0%} of stream_generate "
              f"({ours[1].decode:.1f} vs {single:.1f} tok/s decode)")
    for n in counts:
        vs = f", {ours[n].tps / theirs[n].tps:.2f}x mlx_lm.server" if n in theirs and theirs[n].tps else ""
        print(f"memvisor @{n}: {ours[n].tps / raw[n]:.0%} of raw batched{vs}; max TTFT "
              f"{ours[n].ttft[2] * 1000:.0f} ms" + (f" vs {theirs[n].ttft[2] * 1000:.0f} ms" if n in theirs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
