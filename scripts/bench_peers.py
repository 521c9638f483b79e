"""The engine side by side: the raw batched loop, memvisor and mlx-lm's own server.

    python scripts/bench_batch.py --peers [--model DIR | --size 4MB --dtype float32]
                                      [--streams 1,8,32,64] [--tokens 64] [--skip-mlx-server]
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
- **mlx_lm.server**: `python -m mlx_lm.server --decode-concurrency N
  --prompt-concurrency N`, run through a two-line wrapper that raises
  `ThreadingHTTPServer.request_queue_size` to 1024 (its default of 5 pending
  connections refuses simultaneous arrivals).

On an NVIDIA GPU the sides run one at a time: the two ceilings in a child
process that exits before the servers start, then memvisor, then
mlx_lm.server per stream count, so the device holds one of them at a time
and each peak is its own. Without one (a CPU) the sides run side by side and
take their rounds in turn (ceiling, memvisor, mlx_lm.server, again): on a
shared machine the load moves between minutes, and sides measured minutes
apart gave ratios that swung by 2-3x. The ceilings load OpenBLAS as a worker
does (worker/blas.py), and so does the mlx_lm.server wrapper: on a Linux CPU
all three compute with the same BLAS, and the comparison is of the serving
paths, not of BLAS.

Both servers get the same streaming client (scripts/_sse.py: lean, so the
client's own CPU weighs little on a small machine) and the same prompts,
new in every round (`Story i of round r: ...`, ~20 tokens), so neither
answers from a prompt cache. Per round:

- **tok/s**: tokens / (last token - send), prefill included;
- **decode**: tokens per second while all N streams decode (from the last
  first token to the first end), the figure to set beside the raw loop's;
- **TTFT** min/median/max over the N simultaneous arrivals;
- **peak**: on an NVIDIA GPU, NVML's device bytes of the server's processes
  (per process where NVML names them, else the whole GPU's used bytes over
  the baseline before the server started; sampled every 50 ms); else the
  peak RSS of the server's processes. Next to memvisor's peak at N streams,
  the bound of the issue: 1.5 x (weights + the KV of N x (prompt + tokens) +
  the pool cap, `[guard] pool_max` = 2 GiB by default).

Each side runs a warm-up (2 streams of 8 tokens) and then `--runs` rounds per
stream count, keeping the round of best throughput (as timeit does) and the
peak over all rounds. Figures on a shared CPU are noisy: compare the ratios
printed at the end, within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

from _serve import ServeProcess, add_model_args, model_from_args  # noqa: E402
from _sse import Stream, stream_completion  # noqa: E402

from shared.sizes import format_size  # noqa: E402

GiB = 1024**3
POOL_CAP = 2 * GiB  # [guard] pool_max's default: what M1 lets MLX's pool keep
MLX_SERVER = ("import sys, http.server; http.server.ThreadingHTTPServer.request_queue_size = 1024; "
              "from worker import blas; blas.preload(); "
              "import mlx_lm.server; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; mlx_lm.server.main()")


def prompt(i: int, round_no: int = 0) -> str:
    """Stream i's prompt; every round's are new, so no server answers from its prompt cache."""
    return f"Story {i} of round {round_no}: once upon a time, in a small town by the sea"


ROUNDS = itertools.count(1)


# ------------------------------------------------------------------ in-process ceilings (a child process)


def stream_generate_tps(model: Any, tokenizer: Any, tokens: int, runs: int) -> float:
    import mlx_lm

    best = 0.0
    for _ in range(runs + 1):  # the first run compiles; the best of the rest is kept
        last = None
        for response in mlx_lm.stream_generate(model, tokenizer, prompt(0), max_tokens=tokens):
            last = response
        if last is not None:
            best = max(best, last.generation_tps)
    return best


def raw_batched_tps(model: Any, tokenizer: Any, streams: int, tokens: int, runs: int) -> float:
    """One forward pass per step for `streams` rows of equal length, pipelined one ahead."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

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
        del cache
    return rate


def ceilings_child(model_dir: Path, counts: list[int], tokens: int, runs: int) -> None:
    """The ceilings, printed as one JSON line (run in a child: see the module doc)."""
    from worker import blas

    blas.preload()
    import mlx_lm

    model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(model_dir)))  # no config asked for
    single = stream_generate_tps(model, tokenizer, tokens, runs)
    raw = {n: raw_batched_tps(model, tokenizer, n, tokens, runs) for n in counts}
    print(json.dumps({"single": single, "raw": raw, "prompt_tokens": len(tokenizer.encode(prompt(0)))}))


class Ceilings:
    def __init__(self, single: float, raw: dict[int, float], prompt_tokens: int) -> None:
        self.single, self.raw, self.prompt_tokens = single, raw, prompt_tokens


def ceilings(model_dir: Path, counts: list[int], tokens: int, runs: int) -> Ceilings:
    out = subprocess.run([sys.executable, __file__, "--ceilings-only", "--model", str(model_dir), "--streams",
                          ",".join(map(str, counts)), "--tokens", str(tokens), "--runs", str(runs)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the in-process ceilings failed:\n{out.stderr[-3000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return Ceilings(figures["single"], {int(n): rate for n, rate in figures["raw"].items()}, figures["prompt_tokens"])


# ------------------------------------------------------------------ memory


class Peak:
    """The peak memory of a server's processes while it runs, sampled every 50 ms on a thread.

    With NVML (an NVIDIA GPU): the device bytes NVML gives for the server's
    pids, or, where it names none of them (a container's pid namespace), the
    whole GPU's used bytes over `baseline` (read before the server started).
    Otherwise the RSS of the processes (host memory).
    """

    def __init__(self, pid: int, baseline: int | None) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.baseline = baseline
        self.bytes = 0
        self.how = "RSS" if baseline is None else "device"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _pids(self) -> list[int]:
        import psutil

        try:
            return [self.proc.pid, *(c.pid for c in self.proc.children(recursive=True))]
        except psutil.Error:
            return [self.proc.pid]

    def _sample(self) -> int:
        import psutil

        pids = self._pids()
        if self.baseline is not None:
            from shared.probe import nvml

            reading = nvml.read_device()
            if reading is None:
                return 0
            mine = [reading.per_process[pid] for pid in pids if pid in reading.per_process]
            if mine:
                self.how = "device, NVML per process"
                return sum(mine)
            self.how = "device, whole GPU over baseline"
            return max(0, (reading.used or 0) - self.baseline)
        total = 0
        for pid in pids:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.bytes = max(self.bytes, self._sample())

    def __enter__(self) -> "Peak":
        self.bytes = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def gpu_baseline() -> int | None:
    """Whole-GPU used bytes now (no server running), or None without an NVIDIA device."""
    from shared.probe import nvml

    reading = nvml.read_device()
    return None if reading is None else reading.used or 0


def kv_bytes_per_token(model_dir: Path) -> int:
    """Layers x (K + V) x KV heads x head size x element size, from config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = 4 if config.get("torch_dtype") == "float32" else 2
    return config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", heads) * head_dim * element


# ------------------------------------------------------------------ the servers


def window_rate(streams: list[Stream]) -> float:
    """Tokens per second while every stream decodes: from the last first token to the first end."""
    start = max(s.first for s in streams)
    end = min(s.last for s in streams)
    if end <= start:
        return 0.0
    return sum(sum(1 for t in s.times if start < t <= end) for s in streams) / (end - start)


class Figures:
    def __init__(self, streams: list[Stream], peak: int) -> None:
        start = min(s.sent for s in streams)
        end = max(s.last for s in streams)
        self.tokens = sum(s.tokens for s in streams)
        self.tps = self.tokens / (end - start) if end > start else 0.0
        self.decode = window_rate(streams)
        ttft = sorted(s.first - s.sent for s in streams)
        self.ttft = (ttft[0], statistics.median(ttft), ttft[-1])
        self.peak = peak

    def line(self, name: str, n: int, how: str) -> str:
        lo, mid, hi = self.ttft
        return (f"{name:>14} @{n:<3} {self.tps:8.1f} tok/s, decode {self.decode:8.1f} tok/s  TTFT min/med/max "
                f"{lo * 1000:6.0f}/{mid * 1000:6.0f}/{hi * 1000:6.0f} ms  peak {self.peak / 2**20:8.1f} MiB ({how})")


async def round_of(url: str, model: str, n: int, tokens: int) -> list[Stream]:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    round_no = next(ROUNDS)
    return list(await asyncio.gather(*(stream_completion(url, {**body, "prompt": prompt(i, round_no)})
                                       for i in range(n))))


def run_server(url: str, model: str, pid: int, counts: list[int], tokens: int, runs: int,
               baseline: int | None) -> tuple[dict[int, Figures], str]:
    """Per stream count, the round of best throughput out of `runs` (as timeit: the least disturbed)."""
    asyncio.run(round_of(url, model, 2, 8))  # warm-up: compile, connections
    out = {}
    how = ""
    for n in counts:
        rounds = []
        for _ in range(runs):
            with Peak(pid, baseline) as peak:
                streams = asyncio.run(round_of(url, model, n, tokens))
            how = peak.how
            rounds.append(Figures(streams, peak.bytes))
        out[n] = best(rounds)
    return out, how


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_server(model_dir: Path, n: int, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", MLX_SERVER, "--model", str(model_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--decode-concurrency", str(n), "--prompt-concurrency", str(n)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
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
    raise SystemExit(f"mlx_lm.server did not answer in 180 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, size="4MB", streams="1,8")
    parser.add_argument("--skip-mlx-server", action="store_true", help="leave out mlx_lm.server")
    parser.add_argument("--runs", type=int, default=3, help="rounds per side and stream count, best kept")
    parser.add_argument("--ceilings-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    if not counts or counts[0] < 1:
        parser.error("--streams: at least one count, each >= 1")
    model = model_from_args(args, "engine")
    if args.ceilings_only:
        ceilings_child(model, counts, args.tokens, args.runs)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        run = Run(model, Path(tmp), counts, args.tokens, args.runs, not args.skip_mlx_server)
        if gpu_baseline() is None:
            run.interleaved()
        else:
            run.one_at_a_time()
    summary(model, counts, args.tokens, run.top, run.ours, run.theirs, on_device=run.how.startswith("device"))
    return 0


class Run:
    """The sides of one run: the ceilings, memvisor and mlx_lm.server at each stream count."""

    def __init__(self, model: Path, work: Path, counts: list[int], tokens: int, runs: int, peer: bool) -> None:
        self.model, self.work, self.counts, self.tokens, self.runs, self.peer = model, work, counts, tokens, runs, peer
        self.top = Ceilings(0.0, {}, 0)
        self.ours: dict[int, Figures] = {}
        self.theirs: dict[int, Figures] = {}
        self.how = "RSS"

    def memvisor(self) -> ServeProcess:
        return ServeProcess(f'[[models]]\nid = "bench"\npath = "{self.model}"\npinned = true\n'
                            f"max_concurrency = {max(self.counts)}\n", config=self.work / "bench.toml",
                            runtime=self.work / "rt", log=self.work / "serve.log", timeout=300.0)

    def one_at_a_time(self) -> None:
        """On a GPU: the ceilings in a child, then memvisor alone, then mlx_lm.server alone per count,
        so the device holds one of them at a time and each peak is its own."""
        self.top = ceilings(self.model, self.counts, self.tokens, self.runs)
        self.print_ceilings()
        baseline = gpu_baseline()
        server = self.memvisor()
        try:
            self.ours, self.how = run_server(f"{server.base}/v1/completions", "bench", server.proc.pid, self.counts,
                                             self.tokens, self.runs, baseline)
        finally:
            server.close()
        for n in self.counts:
            print(self.ours[n].line("memvisor", n, self.how), flush=True)
        for n in self.counts if self.peer else []:
            baseline = gpu_baseline()
            proc, base = mlx_server(self.model, n, self.work / f"mlx-{n}.log")
            try:
                figures, how = run_server(f"{base}/v1/completions", str(self.model), proc.pid, [n], self.tokens,
                                          self.runs, baseline)
                self.theirs[n] = figures[n]
            finally:
                stop(proc)
            print(self.theirs[n].line("mlx_lm.server", n, how), flush=True)

    def interleaved(self) -> None:
        """Without a GPU: the ceilings in this process and both servers up together, their rounds
        taken in turn (ceiling, memvisor, mlx_lm.server, again), so the load of a shared machine
        hits every side alike; peaks are RSS, each server's own processes."""
        from worker import blas

        blas.preload()
        import mlx_lm

        model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(self.model)))  # no config asked for
        self.top = Ceilings(0.0, {}, len(tokenizer.encode(prompt(0))))
        stream_generate_tps(model, tokenizer, 8, 0)  # warm-up
        server = self.memvisor()
        ours_url = f"{server.base}/v1/completions"
        try:
            asyncio.run(round_of(ours_url, "bench", 2, 8))  # warm-up
            for n in self.counts:
                peer = mlx_server(self.model, n, self.work / f"mlx-{n}.log") if self.peer else None
                try:
                    if peer is not None:
                        asyncio.run(round_of(f"{peer[1]}/v1/completions", str(self.model), 2, 8))
                    mine, theirs = [], []
                    for _ in range(self.runs):
                        if n == 1:
                            self.top.single = max(self.top.single, stream_generate_tps(model, tokenizer, self.tokens, 0))
                        rate = raw_batched_tps(model, tokenizer, n, self.tokens, 0)
                        self.top.raw[n] = max(self.top.raw.get(n, 0.0), rate)
                        mine.append(measured(ours_url, "bench", server.proc.pid, n, self.tokens))
                        if peer is not None:
                            theirs.append(measured(f"{peer[1]}/v1/completions", str(self.model), peer[0].pid, n,
                                                   self.tokens))
                finally:
                    if peer is not None:
                        stop(peer[0])
                self.ours[n] = best(mine)
                if theirs:
                    self.theirs[n] = best(theirs)
        finally:
            server.close()
        self.print_ceilings()
        for n in self.counts:
            print(self.ours[n].line("memvisor", n, self.how), flush=True)
        for n, figures in self.theirs.items():
            print(figures.line("mlx_lm.server", n, self.how), flush=True)

    def print_ceilings(self) -> None:
        if 1 in self.counts:
            print(f"{'stream_generate':>14} @1   {self.top.single:8.1f} tok/s (decode, in process)", flush=True)
        for n in self.counts:
            print(f"{'raw batched':>14} @{n:<3} {self.top.raw[n]:8.1f} tok/s (decode, in process)", flush=True)


def measured(url: str, model: str, pid: int, n: int, tokens: int) -> Figures:
    """One round of `n` streams with the server's peak RSS."""
    with Peak(pid, None) as peak:
        streams = asyncio.run(round_of(url, model, n, tokens))
    return Figures(streams, peak.bytes)


def best(rounds: list[Figures]) -> Figures:
    """The round of best throughput (as timeit: the least disturbed), with the peak over all."""
    out = max(rounds, key=lambda f: f.tps)
    out.peak = max(f.peak for f in rounds)
    return out


def summary(model: Path, counts: list[int], tokens: int, top: Ceilings, ours: dict[int, Figures],
            theirs: dict[int, Figures], *, on_device: bool) -> None:
    from shared.weights import estimate_weight_bytes

    weights = estimate_weight_bytes(model)
    per_token = kv_bytes_per_token(model)
    print(f"model: {model} ({format_size(weights)} of weights, KV {per_token} B/token); {tokens} max tokens per stream")
    if 1 in ours:
        print(f"memvisor one stream: {ours[1].decode / top.single:.0%} of stream_generate "
              f"({ours[1].decode:.1f} vs {top.single:.1f} tok/s decode)")
    for n in counts:
        mine, peer, raw = ours[n], theirs.get(n), top.raw[n]
        line = f"memvisor @{n}: {mine.tps / raw:.0%} of raw batched ({mine.decode / raw:.0%} decoding)"
        if peer is not None and peer.tps:
            decoding = f"{mine.decode / peer.decode:.2f}x" if peer.decode else "n/a"
            line += (f", {mine.tps / peer.tps:.2f}x mlx_lm.server ({decoding} decoding); "
                     f"max TTFT {mine.ttft[2] * 1000:.0f} vs {peer.ttft[2] * 1000:.0f} ms; "
                     f"peak {mine.peak / GiB:.2f} vs {peer.peak / GiB:.2f} GiB")
        if on_device:
            bound = 1.5 * (weights + n * (top.prompt_tokens + tokens) * per_token + POOL_CAP)
            line += f"; memvisor's peak = {mine.peak / bound:.2f} x 1.5 x (weights + KV + pool cap)"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
