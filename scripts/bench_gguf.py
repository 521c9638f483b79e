"""Serve a GGUF file through memvisor and measure it: `python scripts/bench_gguf.py FILE.gguf [--runs N] [--tokens N]`.

Prints:
  * import + first load time (a fresh cache, so the import really runs), and a
    second load from the cached folder;
  * the weight estimate made from the GGUF header before loading (SPEC A2)
    against what the worker measured after the load (MLX active bytes, usage);
  * decode tokens/s through the supervisor (HTTP streaming) against mlx_lm
    in this process on the same imported folder, runs alternated so drift
    hits both alike. On a shared machine compare the ratio, not the rates.
The last line is the headline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.gguf import read_header
from shared.sizes import format_size

PROMPT = "Once upon a time, in a small village by the sea, there lived"


class Served(ServeProcess):
    """`python -m supervisor serve` on a config whose one model is the .gguf path."""

    def __init__(self, gguf: Path, workdir: Path) -> None:
        env = dict(os.environ, XDG_CACHE_HOME=str(workdir / "cache"))  # a fresh import cache
        super().__init__(f'[[models]]\nid = "gguf"\npath = "{gguf}"\n', config=workdir / "bench.toml",
                         runtime=workdir / "rt", log=workdir / "serve.log", timeout=120.0, env=env)

    def post(self, path: str) -> float:
        import httpx

        started = time.perf_counter()
        r = httpx.post(f"{self.base}{path}", timeout=900)
        if r.status_code != 200:
            raise SystemExit(f"POST {path}: {r.status_code} {r.text}")
        return time.perf_counter() - started

    def worker(self) -> dict:
        import httpx

        workers = httpx.get(f"{self.base}/status", timeout=30).json()["guard"]["workers"]
        return next(w for w in workers if w["model"] == "gguf")

    def decode_rate(self, tokens: int) -> float:
        import httpx

        body = {"model": "gguf", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
        stamps = []
        with httpx.Client(timeout=900) as client, client.stream(
                "POST", f"{self.base}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def in_process_rate(model, tokenizer, tokens: int) -> float:
    import mlx_lm

    stamps = [time.perf_counter() for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens)
              if r.text]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    estimate = read_header(args.gguf).mlx_bytes
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        served = Served(args.gguf.resolve(), Path(tmp))
        try:
            first = served.post("/v1/models/gguf/load")
            time.sleep(1.0)  # one sample after the load
            worker = served.worker()
            served.post("/v1/models/gguf/unload")
            cached = served.post("/v1/models/gguf/load")
            import mlx_lm

            from supervisor.models.gguf_import_cache import cache_folder

            os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
            loaded = mlx_lm.load(str(cache_folder(args.gguf.resolve())))  # (model, tokenizer): no config asked
            model, tokenizer = loaded[0], loaded[1]
            served_rates, local_rates = [], []
            for _ in range(args.runs):
                served_rates.append(served.decode_rate(args.tokens))
                local_rates.append(in_process_rate(model, tokenizer, args.tokens))
        finally:
            served.close()
    s, loc = statistics.median(served_rates), statistics.median(local_rates)
    print(f"import + first load: {first:.1f} s; load from the cached folder: {cached:.1f} s")
    print(f"weights: estimate {format_size(estimate)} (GGUF header, before loading); measured after load: "
          f"MLX active {format_size(worker['mlx_active'])} ({worker['mlx_active'] / estimate:.3f}x), "
          f"worker usage {format_size(worker['usage'])}")
    print(f"decode tokens/s (median of {args.runs}, {args.tokens} tokens): served {s:.1f}, "
          f"in-process mlx_lm {loc:.1f}")
    print(f"headline: served at {s / loc:.0%} of in-process mlx_lm ({s:.1f} vs {loc:.1f} tok/s); first load "
          f"{first:.1f} s, cached {cached:.1f} s; estimate/measured {estimate / worker['mlx_active']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
