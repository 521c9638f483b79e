"""Where a token's time goes on the serving path: the same decode, layer by layer, in one run.

    python scripts/bench_path.py [--model DIR | --size 4MB --dtype float32] [--streams 1,8,32,64]
                                 [--tokens 256] [--runs 5] [--profile DIR]

At each stream count N (N requests sent at once, greedy, `--tokens` each), four layers:

- **ceiling**: in this process, mlx-lm's `stream_generate` (N = 1) or a raw
  batched loop (N > 1: one forward pass per step for N rows, mlx-lm's one-ahead
  pipelining; scripts/bench_peers.py's);
- **engine**: worker/engine.py's step loop in this process (no sockets);
- **worker**: a real worker process (`worker.main.run`) over ZeroMQ, its
  replies drained by a bare receiver here: the engine plus the worker loop
  (ledger, memory sample, frames);
- **server**: `python -m supervisor serve` with the model pinned, N streamed
  `/v1/completions` read by scripts/_sse.py's lean client: plus the
  supervisor, HTTP and SSE.

No layer guesses ahead (`speculative` off): the ceilings decode one token
per step, and so does every layer set against them.

The rate is the decode window's: tokens from the moment every stream has its
first token to the moment the first one ends, over that time, so prefill is in
no layer's figure (the ceiling's is decode alone too). Next to it, the CPU each
process spent per token over the whole round (the worker split by thread:
main, MLX's CPU eval thread, ZeroMQ's I/O thread, ...; these need no quiet
machine to mean something). Rounds are interleaved (every layer once, then
again, every other time in the reverse order); each layer's median is set
against the ceiling's, and each round against the ceiling's round beside it
(the median of those ratios is the figure to compare on a shared machine:
neighbours saw the same load).

This process loads OpenBLAS the way a worker does (worker/blas.py) before
MLX, so the ceilings compute with the same BLAS as the worker.

`--against DIR`: a fifth layer, **base**: the server layer served by the
checkout in DIR (e.g. `git archive main | tar -x -C DIR`), in turn with the
others, so a change's before and after meet the same load; each layer's line
then also gives its per-round ratio to the base's round beside it.

`--profile DIR`: after the rounds at each N, server rounds for
`--profile-seconds` under py-spy and perf stat (scripts/_path_profile.py):
each process's CPU and context switches per token, and py-spy's shares of
its samples per part of the path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker import blas  # noqa: E402

blas.preload()  # before MLX: the ceilings use the worker's BLAS

from _path_profile import profiled  # noqa: E402
from _serve import ServeProcess, add_model_args, model_from_args  # noqa: E402
from _sse import stream_completion  # noqa: E402
from bench_peers import decode_ahead  # noqa: E402

FILLER = ("a keeper walked along the river every morning and counted the boats that passed the old mill "
          "while children waited at the bridge for the train that carried letters to the next town").split()
PROMPT_WORDS = [0]  # --words: 0 keeps the short prompt


def prompt(i: int) -> str:
    """Stream i's prompt: ten distinct ones, so later rounds meet the prompt cache as a server would."""
    words = PROMPT_WORDS[0]
    if not words:
        return f"Story {i % 10}: once upon a time, in a small town by the sea"
    return f"Story {i % 10}: " + " ".join((FILLER * (words // len(FILLER) + 1))[:words])


class Round:
    """One layer's round: the decode-window rate and the CPU per token of each process (or thread)."""

    def __init__(self, rate: float, tokens: int, cpu: dict[str, float]) -> None:
        self.rate, self.tokens, self.cpu = rate, tokens, cpu


def window_rate(times: list[list[float]]) -> float:
    """Tokens per second while every stream decodes: from the last first token to the first end."""
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    if end <= start:
        return 0.0
    return sum(sum(1 for x in t if start < x <= end) for t in times) / (end - start)


class Cpu:
    """CPU seconds of processes (and the worker's threads) between `start()` and `stop()`."""

    def __init__(self, **pids: int) -> None:
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            times = proc.cpu_times()
            out[name] = times.user + times.system
            if name == "worker":
                for thread in proc.threads():
                    label = "main" if thread.id == proc.pid else _thread_name(proc.pid, thread.id)
                    key = f"worker.{label}"
                    out[key] = out.get(key, 0.0) + thread.user_time + thread.system_time
        return out

    def start(self) -> None:
        self.before = self._read()

    def per_token(self, tokens: int) -> dict[str, float]:
        after = self._read()
        return {k: (v - self.before.get(k, 0.0)) / max(1, tokens) for k, v in after.items()}


def _thread_name(pid: int, tid: int) -> str:
    """The kernel's name of a thread (ZeroMQ names its own); MLX's and others' keep the process's."""
    try:
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "gone"
    return "other" if name.startswith("python") else name


# ------------------------------------------------------------------ layers


class Ceiling:
    def __init__(self, model_dir: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(model_dir)))

    def round(self, n: int, tokens: int) -> Round:
        import mlx.core as mx
        import mlx_lm
        from mlx_lm.models.cache import make_prompt_cache

        cpu = Cpu(bench=os.getpid())
        cpu.start()
        if n == 1:
            *_, last = mlx_lm.stream_generate(self.model, self.tokenizer, prompt(0), max_tokens=tokens)
            return Round(last.generation_tps, last.generation_tokens, cpu.per_token(last.generation_tokens))
        ids = self.tokenizer.encode(prompt(0))
        cache = make_prompt_cache(self.model)
        y = mx.argmax(self.model(mx.array([ids] * n), cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        started = time.perf_counter()
        decode_ahead(self.model, cache, y, tokens - 1)  # bench_peers.py's raw loop, the same code
        done = n * (tokens - 1)
        return Round(done / (time.perf_counter() - started), done, cpu.per_token(done))


class EngineLayer:
    def __init__(self, ceiling: Ceiling) -> None:
        self.model, self.tokenizer = ceiling.model, ceiling.tokenizer

    def round(self, n: int, tokens: int) -> Round:
        from shared.limits import Limits
        from shared.protocol import Finished, TokenOut
        from worker.engine import Engine

        engine = Engine(self.model, self.tokenizer, own_usage_fn=lambda: 0, max_concurrency=n)
        ids = {}
        for i in range(n):
            rid = f"r{i}"
            ids[rid] = i
            engine.submit(rid, engine.encode_prompt(prompt(i)), max_tokens=tokens, speculative=False)
        times: list[list[float]] = [[] for _ in range(n)]
        limits = Limits(max_concurrency=n)
        cpu = Cpu(bench=os.getpid())
        cpu.start()
        ended = 0
        while ended < n:
            events = engine.step(limits, lambda: 0)
            now = time.perf_counter()
            for event in events:
                if type(event) is TokenOut:
                    times[ids[event.request_id]].append(now)
                elif isinstance(event, Finished):
                    ended += 1
        count = sum(len(t) for t in times)
        return Round(window_rate(times), count, cpu.per_token(count))


class WorkerLayer:
    """A real worker process, spawned as the supervisor spawns one, against sockets and a ledger of ours."""

    def __init__(self, model_dir: Path, workdir: Path, max_rows: int) -> None:
        import msgspec
        import multiprocess
        import zmq

        from shared import protocol as p
        from shared.ledger import Ledger
        from shared.limits import Limits
        from worker.main import run as worker_main

        self.p = p
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{workdir}/c.sock")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{workdir}/r.sock")
        self.ledger = Ledger.create(workdir / "ledger", 2)
        self.replies, self.commands = p.Codec(p.WorkerReply), p.Codec(p.CommandMsg)
        spec = p.WorkerSpec(worker_id="bench#1", model_id="bench", model_path=str(model_dir), slot=0,
                            ledger_path=str(workdir / "ledger"), commands=f"ipc://{workdir}/c.sock",
                            reports=f"ipc://{workdir}/r.sock", supervisor_pid=os.getpid(), max_concurrency=max_rows)
        self.proc = multiprocess.get_context("spawn").Process(target=worker_main, args=(msgspec.msgpack.encode(spec),))
        self.proc.start()
        self.identity = b""
        self._wait(p.Loaded, 300)
        self.send(p.SetLimits(limits=Limits(max_concurrency=max_rows)))
        self.round(2, 8)  # warm-up: compile, first shapes

    def send(self, msg) -> None:
        self.router.send_multipart([self.identity, self.commands.encode(msg)])

    def _wait(self, want: type, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll(100):
                self.identity, frame = self.router.recv_multipart()
                if isinstance(self.replies.decode(frame), want):
                    return
        raise SystemExit(f"the worker sent no {want.__name__} in {timeout:.0f} s")

    def round(self, n: int, tokens: int) -> Round:
        p = self.p
        stamp = time.monotonic_ns()
        ids = {f"r{i}-{stamp}": i for i in range(n)}
        times: list[list[float]] = [[] for _ in range(n)]
        cpu = Cpu(bench=os.getpid(), worker=cast(int, self.proc.pid))
        cpu.start()
        for rid, i in ids.items():
            self.send(p.Generate(request_id=rid, prompt=prompt(i), max_tokens=tokens, speculative=False))
        ended = 0
        while ended < n:
            while self.pull.poll(0):
                self.pull.recv()  # samples and heartbeats: drained, not read
            if not self.router.poll(100):
                continue
            _, frame = self.router.recv_multipart()
            now = time.perf_counter()
            msg = self.replies.decode(frame)
            if isinstance(msg, p.TokenBatch):
                for rid in msg.request_ids:
                    times[ids[rid]].append(now)
            elif isinstance(msg, p.TokenOut):
                times[ids[msg.request_id]].append(now)
            elif isinstance(msg, (p.Finished, p.Failed)):
                ended += 1
        count = sum(len(t) for t in times)
        return Round(window_rate(times), count, cpu.per_token(count))

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.router.close(0)
        self.pull.close(0)
        self.ctx.term()
        self.ledger.close()


class ServerLayer:
    def __init__(self, model_dir: Path, workdir: Path, max_rows: int, root: Path = ROOT, tag: str = "") -> None:
        self.server = ServeProcess(f'[[models]]\nid = "bench"\npath = "{model_dir}"\npinned = true\n'
                                   f"max_concurrency = {max_rows}\n", config=workdir / f"bench{tag}.toml",
                                   runtime=workdir / f"rt{tag}", log=workdir / f"serve{tag}.log", timeout=300.0,
                                   root=root)
        self.url = f"{self.server.base}/v1/completions"
        self.round(2, 8)  # warm-up: the model loads on first use unless pinned, compile, first shapes
        self.worker_pid = self.server.worker_pid("bench")  # not the spare (W1) beside it

    def cpu(self) -> Cpu:
        """The CPU of this process (the client), the supervisor and (once known) the worker."""
        return Cpu(bench=os.getpid(), supervisor=self.server.proc.pid,
                   **({"worker": self.worker_pid} if hasattr(self, "worker_pid") else {}))

    def round(self, n: int, tokens: int) -> Round:
        cpu = self.cpu()
        cpu.start()
        streams = asyncio.run(self._streams(n, tokens))
        count = sum(len(s.times) for s in streams)
        return Round(window_rate([s.times for s in streams]), count, cpu.per_token(count))

    async def _streams(self, n: int, tokens: int):
        body = {"model": "bench", "max_tokens": tokens, "temperature": 0, "stream": True, "speculative": False}
        return await asyncio.gather(*(stream_completion(self.url, {**body, "prompt": prompt(i)}) for i in range(n)))

    def close(self) -> None:
        self.server.close()


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, size="4MB", streams="1,8,32,64", tokens=256)
    parser.add_argument("--runs", type=int, default=5, help="interleaved rounds per layer and count")
    parser.add_argument("--layers", default="ceiling,engine,worker,server", help="which layers, in order")
    parser.add_argument("--against", type=Path, help="a checkout whose server runs as the 'base' layer (A/B)")
    parser.add_argument("--words", type=int, default=0, help="a prompt of this many words (0: ~15 tokens)")
    parser.add_argument("--profile", type=Path, help="also py-spy the server's rounds per count into this folder")
    parser.add_argument("--profile-seconds", type=float, default=15.0, help="server rounds under py-spy per count")
    parser.add_argument("--profile-rate", type=int, default=400, help="py-spy samples per second")
    args = parser.parse_args(argv)
    counts = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    names = [s.strip() for s in args.layers.split(",") if s.strip()]
    if args.against is not None:
        if not (args.against / "supervisor" / "__main__.py").is_file():
            raise SystemExit(f"--against: {args.against} is not a memvisor checkout")
        names.append("base")
    model = model_from_args(args, "engine")
    PROMPT_WORDS[0] = args.words
    print(f"model {model}; BLAS: {blas.preload().line()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-path-") as tmp:
        work = Path(tmp)
        ceiling = Ceiling(model)
        makers: dict[str, Callable[[], Any]] = {
            "ceiling": lambda: ceiling, "engine": lambda: EngineLayer(ceiling),
            "worker": lambda: WorkerLayer(model, work, max(counts)),
            "server": lambda: ServerLayer(model, work, max(counts)),
            "base": lambda: ServerLayer(model, work, max(counts), root=args.against.resolve(), tag="-base")}
        layers = {name: makers[name]() for name in names}
        try:
            for name in ("ceiling", "engine"):
                if name in layers:
                    layers[name].round(2, 8)  # warm-up
            for n in counts:
                rounds: dict[str, list[Round]] = {name: [] for name in layers}
                for run in range(args.runs):
                    order = list(layers.items())  # every other round backwards: a load that drifts
                    for name, layer in order if run % 2 == 0 else order[::-1]:  # favours no layer
                        rounds[name].append(layer.round(n, args.tokens))
                report(n, rounds)
                if args.profile and "server" in layers:
                    server = layers["server"]
                    profiled(server, n, args.tokens, args.profile, args.profile_seconds, args.profile_rate,
                             server.round, server.cpu)
        finally:
            for name in ("worker", "server", "base"):
                if name in layers:
                    layers[name].close()
    return 0


def report(n: int, rounds: dict[str, list[Round]]) -> None:
    """Per layer: best and median rate, and against the ceiling both the ratio of the medians and
    the median of each round's ratio to the ceiling's round beside it (rounds were taken in turn,
    so a round's neighbour saw the same load)."""
    names = list(rounds)
    base = "ceiling" if "ceiling" in rounds else names[0]
    top = rounds[base]
    top_median = statistics.median(r.rate for r in top)
    for name, rs in rounds.items():
        median = statistics.median(r.rate for r in rs)
        paired = statistics.median(r.rate / t.rate for r, t in zip(rs, top) if t.rate)
        keys = sorted({k for r in rs for k in r.cpu})
        cpu = {k: statistics.median(r.cpu.get(k, 0.0) for r in rs) * 1e6 for k in keys}
        cpu_line = " ".join(f"{k} {v:.0f}" for k, v in cpu.items() if v >= 1)
        against = ""
        if "base" in rounds and name != "base":
            ab = [r.rate / b.rate for r, b in zip(rs, rounds["base"]) if b.rate]
            against = f"; per-round ratio to the base {statistics.median(ab):4.0%}" if ab else ""
        print(f"@{n:<3} {name:8} median {median:8.0f} tok/s ({median / top_median:4.0%} of the {base}'s median; "
              f"per-round ratio median {paired:4.0%}{against}), best {max(r.rate for r in rs):8.0f}; "
              f"CPU us/token (median): {cpu_line}; rounds: {' '.join(f'{r.rate:.0f}' for r in rs)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
