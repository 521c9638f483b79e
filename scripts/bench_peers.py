"""The serving paths side by side, by the team's one streaming client: the in-process ceilings,
memvisor and mlx-lm's own server on one model, in one run.

    python scripts/bench_peers.py [--model DIR | --size 4MB --dtype float32] [--streams 1,8,32,64]
                                  [--tokens 256] [--words 135] [--rounds 2] [--client PATH]
                                  [--skip-mlx-server] [--mlx-prompt-concurrency N] [--json FILE]
    (or python scripts/bench_batch.py --peers with the same flags)

The method is the reference client's (`stream_client.py`, the team's, kept
beside the repository in ../shared/bench/; `--client PATH` or
$MEMVISOR_STREAM_CLIENT names a copy, and `scripts/h200_run.sh stage` puts
one in .bench/ for a machine that has only the work tree). This script
imports that file and runs its own `round_` and `make_prompt`, so every
server gets exactly its requests and its figures:

- a unique ~256-token prompt per request (`--words` 135 on the generated
  models), its round and index first, so no prompt cache serves a prefix;
  `--tokens` (256) greedy tokens, streamed, with the usage chunk: the token
  count is the server's own;
- all N requests sent at once; **whole run** = tokens / (first send -> last
  stream end), prefill included: the headline, printed first; the **decode
  window** beside it (tokens landing between the last first token and the
  first stream end, over that time); TTFT min / median / max per stream;
- the client's warm-up, for every server alike: each N once with 16 tokens,
  so every batch shape a round sees is compiled before the timed rounds.

Sides, each measured at every stream count on the same warm instance:

- **ceilings** (in process, the worker's BLAS): mlx-lm's `stream_generate` at
  one stream, and a raw batched loop (the N prompts cut to the shortest,
  prefilled as one batch, then one forward pass per step, mlx-lm's one-ahead
  pipelining) at every N; their whole-run rate includes their prefill;
- **memvisor**: `python -m supervisor serve`, the model pinned,
  `max_concurrency` = the largest N;
- **mlx_lm.server**: one instance with `--decode-concurrency` = the largest N
  (`--prompt-concurrency` its default unless given), through a two-line
  wrapper that raises `ThreadingHTTPServer.request_queue_size` to 1024 (its 5
  pending connections refuse simultaneous arrivals) and loads the worker's
  BLAS (worker/blas.py) before MLX.

Memory (scripts/_peak.py), sampled every 50 ms through every round: each
server's processes' RSS and USS; on an NVIDIA GPU also NVML's whole-GPU used
bytes (and their rise over a reading taken before the server started) and
the device bytes NVML gives for the server's own pids.

On an NVIDIA GPU the sides run one at a time (the ceilings in a child that
exits first, then memvisor, then mlx_lm.server), so each peak is its own.
On a CPU they are up together and take each round in turn (ceiling,
memvisor, mlx_lm.server at N, then the next N, then the next round), so the
load of a shared machine falls on every side alike: compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _peak import Peak, gpu_used  # noqa: E402
from _serve import ServeProcess, add_model_args, model_from_args  # noqa: E402

CLIENT_ENV = "MEMVISOR_STREAM_CLIENT"
REFERENCE = ROOT.parent / "shared" / "bench" / "stream_client.py"  # the team's, beside the repository
STAGED = ROOT / ".bench" / "stream_client.py"                      # its copy for a lent machine
WARM_TOKENS = 16  # the reference client's warm-up
MLX_SERVER = ("import sys, http.server; http.server.ThreadingHTTPServer.request_queue_size = 1024; "
              "from worker import blas; blas.preload(); "
              "import mlx_lm.server; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; mlx_lm.server.main()")
Result = dict[str, Any]


def load_client(path: Path | None) -> ModuleType:
    """The reference client as a module: `path`, else $MEMVISOR_STREAM_CLIENT, else the team's
    copy beside the repository, else the staged one."""
    env = os.environ.get(CLIENT_ENV)
    where = path or (Path(env) if env else next((p for p in (REFERENCE, STAGED) if p.is_file()), REFERENCE))
    if not where.is_file():
        raise SystemExit(f"no stream client at {where}: give --client PATH (the team's reference is "
                         f"../shared/bench/stream_client.py; `scripts/h200_run.sh stage` copies it to .bench/)")
    spec = importlib.util.spec_from_file_location("stream_client", where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PATH = where  # type: ignore[attr-defined]
    module.SOURCE = f"{where} (sha256 {hashlib.sha256(where.read_bytes()).hexdigest()[:16]})"  # type: ignore[attr-defined]
    return module


# ------------------------------------------------------------------ the ceilings, in process


class Ceilings:
    """stream_generate and the raw batched loop on the client's own prompts."""

    def __init__(self, model_dir: Path, client: ModuleType, words: int) -> None:
        from worker import blas

        blas.preload()  # before MLX: the worker's BLAS
        import mlx_lm

        self.model, self.tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(model_dir)))
        self.client, self.words = client, words

    def prompts(self, tag: str, n: int) -> list[str]:
        return [self.client.make_prompt(f"{tag} request {i}", self.words) for i in range(n)]

    def warm(self, counts: list[int]) -> None:
        for n in counts:
            self.round(f"warm{n}", n, WARM_TOKENS)

    def round(self, tag: str, n: int, tokens: int) -> list[Result]:
        out = [self.raw(tag, n, tokens)]
        if n == 1:
            out.insert(0, self.stream_generate(tag, tokens))
        return out

    def stream_generate(self, tag: str, tokens: int) -> Result:
        import mlx_lm

        started = time.perf_counter()
        first, last = 0.0, None
        for response in mlx_lm.stream_generate(self.model, self.tokenizer, self.prompts(tag, 1)[0], max_tokens=tokens):
            first = first or time.perf_counter()
            last = response
        wall = time.perf_counter() - started
        assert last is not None
        return figures("stream_generate", 1, last.generation_tokens, wall, first - started, last.generation_tps,
                       last.prompt_tokens)

    def raw(self, tag: str, n: int, tokens: int) -> Result:
        """One forward pass per step for n rows, pipelined one ahead (mlx-lm's generate_step)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        ids = [self.tokenizer.encode(p) for p in self.prompts(tag, n)]
        length = min(len(row) for row in ids)
        started = time.perf_counter()
        cache = make_prompt_cache(self.model)
        y = mx.argmax(self.model(mx.array([row[:length] for row in ids]), cache=cache)[:, -1, :], axis=-1)
        y.tolist()
        first = time.perf_counter()
        decode_ahead(self.model, cache, y, tokens - 1)
        end = time.perf_counter()
        decode = n * (tokens - 1) / (end - first) if tokens > 1 else 0.0
        return figures("raw", n, n * tokens, end - started, first - started, decode, length)


def decode_ahead(model: Any, cache: Any, y: Any, steps: int) -> None:
    """`steps` greedy tokens for every row of `y` (the last tokens, one a row), each step queued
    before the one before it is read: mlx-lm's own pipelining (`generate_step`), the raw loop."""
    import mlx.core as mx

    for _ in range(steps):
        following = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(following)
        y.tolist()
        y = following
    y.tolist()


def figures(side: str, n: int, tokens: int, wall: float, ttft: float, decode: float, prompt: int) -> Result:
    """A ceiling's round in the client's own keys (its TTFT is the whole batch's prefill)."""
    return {"side": side, "n": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "window_tps": decode,
            "ttft_min_s": ttft, "ttft_median_s": ttft, "ttft_max_s": ttft, "prompt_tokens": [prompt],
            "short_streams": 0}


def ceilings_child(model: Path, client: ModuleType, args: argparse.Namespace, counts: list[int]) -> list[Result]:
    """On a GPU: the ceilings in a child process that exits before a server starts."""
    cmd = [sys.executable, __file__, "--ceilings-only", "--model", str(model), "--streams", ",".join(map(str, counts)),
           "--tokens", str(args.tokens), "--words", str(args.words), "--rounds", str(args.rounds),
           "--client", str(client.PATH)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the in-process ceilings failed:\n{out.stderr[-3000:]}")
    results = cast(list[Result], json.loads(out.stdout.strip().splitlines()[-1]))
    for result in results:
        print(line(result), flush=True)
    return results


# ------------------------------------------------------------------ the servers


class Server:
    """A server under the client: its warm-up, its rounds, each round's peak memory."""

    def __init__(self, side: str, base: str, model: str, pid: int, client: ModuleType, words: int,
                 baseline: int | None) -> None:
        self.side, self.base, self.model, self.pid = side, base, model, pid
        self.client, self.words, self.baseline = client, words, baseline
        self.proc = client.Proc(pid)  # the client's CPU accounting: the server and its children

    def warm(self, counts: list[int]) -> None:
        started = time.perf_counter()
        for n in counts:
            asyncio.run(self.client.round_(self.base, self.model, n, WARM_TOKENS, self.words, f"warm{n}", self.proc))
        print(f"{self.side}: warm-up (each N once, {WARM_TOKENS} tokens) in {time.perf_counter() - started:.1f} s",
              flush=True)

    def round(self, tag: str, n: int, tokens: int) -> list[Result]:
        with Peak(self.pid, gpu=self.baseline is not None) as peak:
            out = asyncio.run(self.client.round_(self.base, self.model, n, tokens, self.words, tag, self.proc))
        out.update(peak.figures(self.baseline), side=self.side)
        out.pop("ttfts_s", None)
        return [out]


def memvisor(model: Path, work: Path, counts: list[int], client: ModuleType, words: int,
             baseline: int | None) -> tuple[ServeProcess, Server]:
    serve = ServeProcess(f'[[models]]\nid = "bench"\npath = "{model}"\npinned = true\n'
                         f"max_concurrency = {max(counts)}\n", config=work / "bench.toml", runtime=work / "rt",
                         log=work / "serve.log", timeout=600.0)
    return serve, Server("memvisor", serve.base, "bench", serve.proc.pid, client, words, baseline)


def mlx_server(model: Path, work: Path, counts: list[int], prompt_concurrency: int | None, client: ModuleType,
               words: int, baseline: int | None) -> tuple[subprocess.Popen, Server]:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ["--prompt-concurrency", str(prompt_concurrency)] if prompt_concurrency else []
    log = work / "mlx_lm.server.log"
    proc = subprocess.Popen([sys.executable, "-c", MLX_SERVER, "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--decode-concurrency", str(max(counts)), *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mlx_lm.server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, Server("mlx_lm.server", base, str(model), proc.pid, client, words, baseline)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("mlx_lm.server did not answer in 600 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


# ------------------------------------------------------------------ the run


def rounds_of(sides: list[Any], counts: list[int], rounds: int, tokens: int) -> list[Result]:
    """Every side warmed, then round r at each N, the sides in turn at each N."""
    for side in sides:
        side.warm(counts)
    out = []
    for r in range(rounds):
        for n in counts:
            for side in sides:
                for result in side.round(f"r{r}n{n}", n, tokens):
                    result["round"] = r
                    out.append(result)
                    print(line(result), flush=True)
    return out


def one_at_a_time(model: Path, work: Path, client: ModuleType, args: argparse.Namespace,
                  counts: list[int]) -> list[Result]:
    """On a GPU: the ceilings in a child, then each server alone on the device."""
    results = [] if args.skip_ceilings else ceilings_child(model, client, args, counts)
    serve, ours = memvisor(model, work, counts, client, args.words, gpu_used())
    try:
        results += rounds_of([ours], counts, args.rounds, args.tokens)
    finally:
        serve.close()
    if not args.skip_mlx_server:
        proc, theirs = mlx_server(model, work, counts, args.mlx_prompt_concurrency, client, args.words, gpu_used())
        try:
            results += rounds_of([theirs], counts, args.rounds, args.tokens)
        finally:
            stop(proc)
    return results


def interleaved(model: Path, work: Path, client: ModuleType, args: argparse.Namespace,
                counts: list[int]) -> list[Result]:
    """On a CPU: every side up at once, their rounds taken in turn."""
    sides: list[Any] = [] if args.skip_ceilings else [Ceilings(model, client, args.words)]
    serve, ours = memvisor(model, work, counts, client, args.words, None)
    proc = None
    try:
        sides.append(ours)
        if not args.skip_mlx_server:
            proc, theirs = mlx_server(model, work, counts, args.mlx_prompt_concurrency, client, args.words, None)
            sides.append(theirs)
        return rounds_of(sides, counts, args.rounds, args.tokens)
    finally:
        serve.close()
        if proc is not None:
            stop(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, size="4MB", streams="1,8,32,64", tokens=256)
    parser.add_argument("--words", type=int, default=135, help="prompt words (135: ~256 tokens on make_model's vocab)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per side and stream count")
    parser.add_argument("--runs", type=int, help=argparse.SUPPRESS)  # the old name of --rounds
    parser.add_argument("--client", type=Path, help=f"the reference stream_client.py (default: ${CLIENT_ENV}, "
                        "else ../shared/bench/stream_client.py, else .bench/stream_client.py)")
    parser.add_argument("--skip-mlx-server", action="store_true", help="leave out mlx_lm.server")
    parser.add_argument("--skip-ceilings", action="store_true", help="leave out the in-process ceilings")
    parser.add_argument("--mlx-prompt-concurrency", type=int, help="mlx_lm.server's --prompt-concurrency "
                        "(default: its own, 8)")
    parser.add_argument("--json", type=Path, help="write every round's figures to this file")
    parser.add_argument("--ceilings-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.runs or args.rounds
    counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    if not counts or counts[0] < 1 or args.tokens < 2:
        parser.error("--streams: at least one count, each >= 1; --tokens >= 2")
    client = load_client(args.client)
    model = model_from_args(args, "engine")
    if args.ceilings_only:
        sides = [Ceilings(model, client, args.words)]
        print(json.dumps(rounds_of(sides, counts, args.rounds, args.tokens)))
        return 0
    gpu = gpu_used() is not None
    print(f"model {model}; client {client.SOURCE}; {args.tokens} tokens a stream, ~{args.words}-word prompts, "
          f"{args.rounds} rounds; {'NVIDIA GPU: sides one at a time' if gpu else 'CPU: sides in turn'}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        run = one_at_a_time if gpu else interleaved
        results = run(model, Path(tmp), client, args, counts)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "client": client.SOURCE, "tokens": args.tokens,
                                         "words": args.words, "gpu": gpu, "rounds": results}, indent=1))
    summary(results, counts, gpu)
    return 0


# ------------------------------------------------------------------ printing


def line(r: Result) -> str:
    """One round: the whole-run rate first, the decode window beside it, TTFT, memory."""
    text = (f"{r['side']:>15} @{r['n']:<3} r{r.get('round', 0)}: whole run {r['tok_s']:8.1f} tok/s "
            f"({r['tokens']} tok in {r['wall_s']:.2f} s), decode window {r['window_tps']:8.1f} tok/s; TTFT "
            f"min/med/max {r['ttft_min_s'] * 1e3:.0f}/{r['ttft_median_s'] * 1e3:.0f}/{r['ttft_max_s'] * 1e3:.0f} ms; "
            f"prompt tokens {r['prompt_tokens']}; short {r['short_streams']}")
    if "rss_gib" in r:
        text += (f"; CPU {r['cpu_main_us_per_tok']:.0f}+{r['cpu_children_us_per_tok']:.0f} us/tok; "
                 f"peak RSS {r['rss_gib']:.3f} USS {r['uss_gib']:.3f} GiB")
    if "gpu_total_gib" in r:
        procs = r["gpu_procs_gib"]
        text += (f"; GPU whole {r['gpu_total_gib']:.2f} GiB (+{r['gpu_over_baseline_gib']:.2f} over baseline), "
                 f"its processes {'n/a' if procs is None else f'{procs:.2f}'} GiB")
    return text


def med(results: list[Result], side: str, n: int, key: str) -> float | None:
    values = [r[key] for r in results if r["side"] == side and r["n"] == n and r.get(key) is not None]
    return statistics.median(values) if values else None


def top(results: list[Result], side: str, key: str) -> float | None:
    values = [r[key] for r in results if r["side"] == side and r.get(key) is not None]
    return max(values) if values else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def summary(results: list[Result], counts: list[int], gpu: bool) -> None:
    """Medians over the rounds; ratios of medians measured in this run."""
    print("\nmedians over the rounds (whole run = first send -> last end, prefill included; decode window beside)")
    for n in counts:
        ours = (med(results, "memvisor", n, "tok_s"), med(results, "memvisor", n, "window_tps"))
        for peer in ("stream_generate", "raw", "mlx_lm.server"):
            theirs = (med(results, peer, n, "tok_s"), med(results, peer, n, "window_tps"))
            if theirs[0] is None:
                continue
            print(f"memvisor @{n:<3} vs {peer:>15}: whole run {ours[0] or 0:8.1f} vs {theirs[0]:8.1f} tok/s "
                  f"({ratio(ours[0], theirs[0])}); decode window {ours[1] or 0:8.1f} vs {theirs[1] or 0:8.1f} "
                  f"({ratio(ours[1], theirs[1])}); TTFT median {1e3 * (med(results, 'memvisor', n, 'ttft_median_s') or 0):.0f}"
                  f" vs {1e3 * (med(results, peer, n, 'ttft_median_s') or 0):.0f} ms")
    keys = ("gpu_over_baseline_gib", "gpu_procs_gib", "gpu_total_gib") if gpu else ("uss_gib", "rss_gib")
    for key in keys:
        a, b = top(results, "memvisor", key), top(results, "mlx_lm.server", key)
        print(f"peak {key[:-4]} over every round: memvisor {a if a is None else f'{a:.3f}'} GiB, "
              f"mlx_lm.server {b if b is None else f'{b:.3f}'} GiB ({ratio(a, b)})")


if __name__ == "__main__":
    sys.exit(main())
