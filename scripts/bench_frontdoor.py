"""Front door overhead: tokens/s streamed through HTTP vs mlx_lm in-process.

    python scripts/bench_frontdoor.py [--size 400MB] [--tokens 256] [--runs 3]

One run, one generated model (~100M parameters, float32 by default: MLX's
CPU backend runs float32 fastest, so the model is as fast as it gets and the
front door's share of each token is as visible as it gets), one prompt:

- in-process: `mlx_lm.stream_generate` in this process, greedy;
- front door: `python -m supervisor serve` in a subprocess with the model
  pinned, the same prompt sent to `/v1/completions` with `"stream": true`
  (greedy), read as SSE by httpx; every token crosses worker -> ZeroMQ ->
  supervisor -> HTTP.

Decode throughput is (tokens - 1) / (last token - first token), so it
measures the steady stream, not the prefill; TTFT is request sent -> first
token, measured separately over more runs of one token each. Runs alternate
between the two sides after one warm-up each, and medians are compared.

A third TTFT reference, the bare model (prefill + one greedy step, no
generation loop), separates the front door's hop from mlx_lm's own loop:
`stream_generate` queues the second step before it hands out the first
token, which on CPU costs about one decode step, so the front door's TTFT
can come out *below* in-process mlx_lm's. The hop over the bare model is
printed too. The last line is the figure the issue asks for:

    front door: X% of in-process tokens/s, TTFT +Y ms
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, bench_model  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import parse_size  # noqa: E402

# Short on purpose: MLX's CPU prefill costs about as much per prompt token as a
# decode step, and a long prefill's jitter would drown the front door's TTFT.
PROMPT = "Once upon a time, in a machine with little memory,"


def ensure_model(size: int, dtype: str) -> Path:
    return bench_model(f"frontdoor-{size}-{dtype}", size, 7, dtype)


class Run:
    def __init__(self, sent: float, first: float, last: float, tokens: int) -> None:
        self.ttft = first - sent
        self.tokens = tokens
        self.tps = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0


# ---------------------------------------------------------------------------
# in-process


class InProcess:
    def __init__(self, path: Path) -> None:
        import mlx_lm

        self.mlx_lm = mlx_lm
        loaded = mlx_lm.load(str(path))  # (model, tokenizer): no config asked
        self.model, self.tokenizer = loaded[0], loaded[1]

    def bare_first_token(self) -> float:
        """Prefill + one greedy step with no generation loop around it: the floor any
        server's TTFT stands on (mlx_lm's loop queues the second step before handing
        out the first token, which costs about one decode step on CPU)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        ids = self.tokenizer.encode(PROMPT)
        sent = time.perf_counter()
        cache = make_prompt_cache(self.model)
        self.model(mx.array([ids[:-1]]), cache=cache)
        self.model(mx.array([ids[-1:]]), cache=cache)[0, -1].argmax().item()
        return time.perf_counter() - sent

    def run(self, tokens: int) -> Run:
        sent = time.perf_counter()
        first = last = 0.0
        n = 0
        for _ in self.mlx_lm.stream_generate(self.model, self.tokenizer, PROMPT, max_tokens=tokens):
            last = time.perf_counter()
            if n == 0:
                first = last
            n += 1
        return Run(sent, first, last, n)


class BareFirstToken:
    """`InProcess.bare_first_token` as a side of the TTFT comparison."""

    def __init__(self, local: InProcess) -> None:
        self.local = local

    def run(self, tokens: int) -> Run:
        seconds = self.local.bare_first_token()
        return Run(0.0, seconds, seconds, 1)


# ---------------------------------------------------------------------------
# through the front door


class FrontDoor(ServeProcess):
    def __init__(self, path: Path, workdir: Path) -> None:
        super().__init__(f'[[models]]\nid = "bench"\npath = "{path}"\npinned = true\n',
                         config=workdir / "bench.toml", runtime=workdir / "rt", log=workdir / "serve.log",
                         timeout=180.0)
        self.cpu_seconds = 0.0  # the supervisor's own CPU (not its workers') during runs
        self.tokens = 0

    def run(self, tokens: int) -> Run:
        import httpx

        body = {"model": "bench", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        import psutil

        first = last = 0.0
        count = 0
        supervisor = psutil.Process(self.proc.pid)
        cpu_before = sum(supervisor.cpu_times()[:2])
        with httpx.Client(timeout=300) as client:
            sent = time.perf_counter()
            with client.stream("POST", f"{self.base}/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        count = event["usage"]["completion_tokens"]
                    elif event["choices"]:  # a token, or the finish right behind the last one
                        if first == 0.0:
                            first = now
                        last = now
        self.cpu_seconds += sum(supervisor.cpu_times()[:2]) - cpu_before
        self.tokens += count
        return Run(sent, first, last, count)


def measure(sides, runs: int, tokens: int, verbose: bool) -> dict[str, list[Run]]:
    """Alternate the sides run by run, so drift (thermal, other load) hits both alike."""
    results: dict[str, list[Run]] = {name: [] for name, _ in sides}
    for i in range(runs):
        for name, side in sides:
            run = side.run(tokens)
            results[name].append(run)
            if verbose:
                print(f"run {i + 1} {name:>10}: {run.tokens} tokens, {run.tps:7.1f} tokens/s, "
                      f"TTFT {run.ttft * 1000:6.1f} ms", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="400MB", help="weights of the generated model (default 400MB: "
                        "~100M float32 parameters)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per run")
    parser.add_argument("--runs", type=int, default=3, help="measured throughput runs per side")
    parser.add_argument("--ttft-runs", type=int, default=10, help="measured one-token runs per side")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    path = ensure_model(size, args.dtype)
    with tempfile.TemporaryDirectory(prefix="bench-fd-") as tmp:
        door = FrontDoor(path, Path(tmp))
        try:
            local = InProcess(path)
            sides = (("in-process", local), ("front door", door))
            for _name, side in sides:
                side.run(16)  # warm-up: compile, caches, connections
            door.cpu_seconds, door.tokens = 0.0, 0
            results = measure(sides, args.runs, args.tokens, verbose=True)
            firsts = measure(sides + (("bare model", BareFirstToken(local)),), args.ttft_runs, 1, verbose=False)
        finally:
            door.close()
    tps = {k: statistics.median(r.tps for r in v) for k, v in results.items()}
    ttft = {k: statistics.median(r.ttft for r in v) for k, v in firsts.items()}
    print(f"model: {path.name}; prompt {PROMPT!r}; medians of {args.runs} runs of {args.tokens} tokens "
          f"(throughput) and {args.ttft_runs} runs of 1 token (TTFT)")
    for name in results:
        print(f"{name:>10}: {tps[name]:7.1f} tokens/s, TTFT {ttft[name] * 1000:6.1f} ms")
    print(f"bare model prefill + first token: {ttft['bare model'] * 1000:6.1f} ms (front door hop over it: "
          f"{(ttft['front door'] - ttft['bare model']) * 1000:+.1f} ms)")
    if door.tokens:
        print(f"supervisor CPU (HTTP + ZeroMQ + guard) per streamed token: "
              f"{door.cpu_seconds / door.tokens * 1e6:.0f} us")
    share = 100.0 * tps["front door"] / tps["in-process"] if tps["in-process"] else 0.0
    overhead = (ttft["front door"] - ttft["in-process"]) * 1000
    print(f"front door: {share:.1f}% of in-process tokens/s, TTFT {overhead:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
