"""Images in, measured: the served vision model against mlx-vlm in process, and G1's estimate of an
image prefill's peak against the measured one (docs/vision.md).

    python scripts/bench_vision.py [--model DIR] [--tokens 48] [--images 2] [--side 448] [--json FILE]

One run prints three tables, each a ratio measured in that run:

1. **Throughput.** The same model (default: demo-vision's dims, generated once under the benchmarks'
   cache) answers image requests (`--images` images of `--side` x `--side` pixels, a different
   image each request, greedy, `--tokens` tokens) through `python -m supervisor serve` (streamed
   chat completions, 1 and 4 at once) and through mlx-vlm's own `stream_generate` in this process
   (one at a time), both on the workers' OpenBLAS (worker/blas.py). TTFT, decode tokens/s per
   stream (from its first token to its last: with 4 at once the others' prefills run between its
   steps), and all streams' tokens over the wall time; the goal: served >= 80 % of in-process
   tokens/s at one stream.
2. **Prefill peak per image size.** In a fresh process per row, an image request is prefilled the
   way the engine does it (worker/vision.py: the tower's turn, then the chunks; guard off, chunks of
   512 by memory only); measured: MLX's peak above the state before (`mx.get_peak_memory`) and the
   process's anonymous resident memory's (`RssAnon` sampled each millisecond, Linux: what the guard's
   usage counts), the larger is `peak`. Beside it G1's estimate from the prior
   (what G1 uses before any tower ran: worker/vision_cost.py, worker/prefill_cost.py) and after one
   run has taught it; the goal: 1.00 <= estimate / peak <= 1.25.
3. **Held behind an image.** A short text request queued behind an image request's prefill, against
   the same text request behind a text prompt of the image prompt's token count: seconds to its
   first token each, in this process (the engine alone, no server).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, cache_root, proc_status  # noqa: E402
from _sse import stream_completion  # noqa: E402

from worker import blas  # noqa: E402

blas.preload()  # in process, the BLAS the workers use (MLX's stock CPU BLAS is several times slower)

PROMPT = "Describe this image."
SHAPES = [(224, 224, 1), (448, 448, 1), (448, 224, 1), (160, 800, 1), (448, 448, 2), (1024, 768, 1), (448, 448, 4)]


def picture(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_input(data: bytes):
    """The wire's ImageInput as the front door sends it (its digest filled)."""
    import hashlib

    from shared import protocol as p

    return p.ImageInput(data=data, digest=hashlib.sha256(data).hexdigest(), format="PNG")


def turn(text: str, images: int):
    """A user turn: `images` images, then the text."""
    from shared import protocol as p

    parts = [p.MessagePart(image=i) for i in range(images)] + [p.MessagePart(text=text)]
    return p.ChatMessage(role="user", content=text, parts=parts)


def default_model() -> Path:
    from modelfiles.vlmgen import make_vision_model

    path = cache_root() / "vision-demo"
    if not (path / "config.json").exists():
        print(f"generating demo-vision's dims in {path} (once)...", flush=True)
        make_vision_model(path, seed=4, force=True)
    return path


# -- 1. throughput ---------------------------------------------------------------------------


def in_process(model_dir: Path, images: int, side: int, tokens: int, runs: int = 3) -> dict:
    """mlx-vlm's stream_generate, one request at a time: TTFT and decode tokens/s (medians)."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    stream_generate: Any = mlx_vlm.stream_generate  # its types say image paths; it takes PIL images too
    model, processor = mlx_vlm.load(str(model_dir))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=images)
    ttfts, rates, totals = [], [], []
    for run in range(runs + 1):  # the first is a warm-up
        pictures = [Image.open(io.BytesIO(picture(side, side, 1000 * run + i))) for i in range(images)]
        started = time.perf_counter()
        first = last = 0.0
        count = 0
        for _ in stream_generate(model, processor, prompt, image=pictures, max_tokens=tokens, temperature=0.0):
            last = time.perf_counter()
            first = first or last
            count += 1
        if run:
            ttfts.append(first - started)
            rates.append((count - 1) / (last - first) if count > 1 and last > first else 0.0)
            totals.append(count / (last - started))
    del model
    gc.collect()
    return {"ttft": statistics.median(ttfts), "tok_s": statistics.median(rates), "total_tok_s": statistics.median(totals)}


def served(model_dir: Path, images: int, side: int, tokens: int, streams: int, rounds: int = 3) -> dict:
    """Streamed chat completions through `serve`, `streams` at once: TTFT and per-stream decode tokens/s."""
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    config = (f"[guard]\nhot_cache_max = 0\n[supervisor]\nmax_images = {max(8, images)}\nmax_body = \"1MiB\"\n"
              f"[[models]]\nid = \"eyes\"\npath = \"{model_dir}\"\nmax_concurrency = {max(4, streams)}\n")
    server = ServeProcess(config, config=work / "config.toml", runtime=work / "rt", log=work / "serve.log",
                          timeout=120)
    url = server.base + "/v1/chat/completions"

    def body(seed: int) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": data_url(picture(side, side, seed + i))}}
                 for i in range(images)]
        return {"model": "eyes", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": tokens,
                "temperature": 0, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]}

    async def round_of(seed: int):
        return await asyncio.gather(*(stream_completion(url, body(seed + 100 * s)) for s in range(streams)))

    try:
        asyncio.run(round_of(999_000))  # warm-up: the load, the first tower
        results = [s for r in range(rounds) for s in asyncio.run(round_of(10_000 * (r + 1)))]
    finally:
        server.close()
    ttfts = [s.first - s.sent for s in results]
    rates = [(s.chunks - 1) / (s.last - s.first) for s in results if s.chunks > 1 and s.last > s.first]
    by_round = [results[r * streams:(r + 1) * streams] for r in range(rounds)]
    total = statistics.median(sum(s.tokens for s in group) / (max(s.last for s in group) - min(s.sent for s in group))
                              for group in by_round)
    return {"ttft": statistics.median(ttfts), "tok_s": statistics.median(rates) if rates else 0.0, "total_tok_s": total}


# -- 2. the prefill peak ------------------------------------------------------------------------


class AnonPeak:
    """The most the process's anonymous resident memory (Linux `RssAnon`: what the guard's usage, SPEC U1,
    counts) grew above its start while the block ran, sampled every millisecond on a thread (MLX
    releases the GIL while it computes). `VmHWM` would count the library pages a first run touches too."""

    def __enter__(self) -> "AnonPeak":
        import threading

        self.start = proc_status("RssAnon") or 0
        self.high = self.start
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.done.wait(0.001):
            self.high = max(self.high, proc_status("RssAnon") or 0)

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.high = max(self.high, proc_status("RssAnon") or 0)

    @property
    def grown(self) -> int:
        return self.high - self.start


def peak_one(model_dir: Path, width: int, height: int, count: int) -> dict:
    """In this (fresh) process: one image request prefilled as the engine does it, twice (the second
    after the first taught the tower's cost), measured against G1's estimate each time."""
    import mlx.core as mx

    from shared import protocol as p
    from shared.limits import Limits
    from worker import vision_cost
    from worker.prefill_guard import estimate_prefill_peak
    from worker.vision import VisionEngine

    engine = VisionEngine.load(model_dir, chunk_seconds=0, own_usage_fn=lambda: 0)
    rows = []
    for run in range(2):
        images = [image_input(picture(width, height, 50 * run + i)) for i in range(count)]
        engine.submit_generate(p.Generate(request_id=f"r{run}", messages=[turn(PROMPT, count)],
                                          images=images, max_tokens=1, temperature=0.0))
        seq = engine.scheduler.queue[0]
        media, n = seq.media, len(seq.prompt)
        limits = Limits(max_concurrency=1, hard_limit=1 << 50, min_chunk_tokens=engine.max_chunk)
        g1 = engine.prefill.verdict(seq, engine.prefill.pool(limits, lambda: 0)).estimated_bytes
        lm = estimate_prefill_peak(n, engine.prefill.cost, engine.max_chunk)
        tower = vision_cost.peak(engine.vision.cost, media.tiles, media.embed_bytes)
        estimate = media.embed_bytes + max(lm, tower)  # G1's figure without the chunk in flight's pad
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        anon = AnonPeak()
        mlx_peak = 0
        with anon:
            while seq.state != "decoding" and seq.state != "ended":  # the engine resets MLX's peak per chunk
                engine.step(Limits(max_concurrency=1), lambda: 0)
                mlx_peak = max(mlx_peak, mx.get_peak_memory() - before)
        footprint = anon.grown
        while engine.has_work:
            engine.step(Limits(max_concurrency=1), lambda: 0)
        peak = max(mlx_peak, footprint)
        rows.append({"run": run, "tiles": media.tiles, "tokens": n, "mlx_peak": mlx_peak, "footprint": footprint,
                     "estimate": estimate, "g1": g1, "ratio": estimate / peak if peak else 0.0})
    return {"size": f"{width}x{height}", "images": count, "rows": rows}


def peaks(model_dir: Path) -> list[dict]:
    out = []
    for width, height, count in SHAPES:
        done = subprocess.run([sys.executable, __file__, "--model", str(model_dir), "--peak-one",
                               f"{width}x{height}x{count}"], capture_output=True, text=True, timeout=900, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"peak run {width}x{height}x{count} failed:\n{done.stderr[-2000:]}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


# -- 3. held behind an image ---------------------------------------------------------------------


def held_behind(model_dir: Path, images: int, side: int) -> dict:
    """Seconds to a short text request's first token when it is queued behind an image request, and
    behind a text prompt of the same token count (the engine alone, in this process)."""
    from shared import protocol as p
    from shared.limits import Limits
    from shared.protocol import TokenOut
    from worker.vision import VisionEngine

    engine = VisionEngine.load(model_dir, own_usage_fn=lambda: 0)
    short = p.ChatMessage(role="user", content="Hi there.")
    out: dict[str, float] = {}
    for kind in ("warm-up", "image", "text"):
        pics = [image_input(picture(side, side, 7 + i + len(out))) for i in range(images)]
        head = p.Generate(request_id=f"{kind}-head", messages=[turn(PROMPT, images)], images=pics,
                          max_tokens=8, temperature=0.0)
        if kind == "text":  # a prompt of the image prompt's token count, in words
            n = int(out["tokens"])
            words = " ".join(["memory guard tower"] * n)
            ids = engine.encode_prompt(words)[:n]
            engine.submit(head.request_id, ids, max_tokens=8)
        else:
            engine.submit_generate(head)
            out["tokens"] = len(engine.scheduler.queue[0].prompt)
        started = time.perf_counter()
        engine.submit_generate(p.Generate(request_id=f"{kind}-short", messages=[short], max_tokens=4, temperature=0.0))
        first = 0.0
        while engine.has_work:
            for ev in engine.step(Limits(max_concurrency=8), lambda: 0):
                if isinstance(ev, TokenOut) and ev.request_id.endswith("-short") and not first:
                    first = time.perf_counter() - started
        if kind != "warm-up":
            out[kind] = first
    return {"prompt_tokens": out["tokens"], "behind_image_s": out["image"], "behind_text_s": out["text"],
            "ratio": out["image"] / out["text"]}


# -- the report ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a VLM folder (default: demo-vision's dims, generated once)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each request generates")
    parser.add_argument("--images", type=int, default=2, help="images a request carries")
    parser.add_argument("--side", type=int, default=448, help="the images' width and height")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--tables", default="1,2,3", help="which tables to run (default all)")
    parser.add_argument("--peak-one", help=argparse.SUPPRESS)  # WxHxN: one row of table 2, in a child
    args = parser.parse_args()
    model = args.model or default_model()
    if args.peak_one:
        width, height, count = (int(x) for x in args.peak_one.split("x"))
        print(json.dumps(peak_one(model, width, height, count)))
        return
    report: dict = {"model": str(model), "images": args.images, "side": args.side, "tokens": args.tokens}
    tables = set(args.tables.split(","))
    if "1" in tables:
        report["in_process"] = in_process(model, args.images, args.side, args.tokens)
        report["served_1"] = served(model, args.images, args.side, args.tokens, 1)
        report["served_4"] = served(model, args.images, args.side, args.tokens, 4)
    if "2" in tables:
        report["peaks"] = peaks(model)
    if "3" in tables:
        report["held"] = held_behind(model, args.images, args.side)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def print_report(r: dict) -> None:
    if "in_process" in r:
        _throughput(r)
    if "peaks" in r:
        _peaks(r)
    if "held" in r:
        h = r["held"]
        print(f"\n3. a short text request behind a {h['prompt_tokens']}-token prefill: {h['behind_image_s']:.2f} s "
              f"behind the image, {h['behind_text_s']:.2f} s behind text ({h['ratio']:.2f}x)")


def _throughput(r: dict) -> None:
    ip, s1, s4 = r["in_process"], r["served_1"], r["served_4"]
    print(f"\n1. throughput: {r['images']} images of {r['side']}x{r['side']}, {r['tokens']} tokens, greedy")
    print(f"{'':24}{'TTFT s':>8}{'tok/s/stream':>14}{'vs in-process':>15}{'all streams tok/s':>19}")
    for name, row in (("mlx-vlm in process", ip), ("served, 1 stream", s1), ("served, 4 at once", s4)):
        print(f"{name:24}{row['ttft']:8.2f}{row['tok_s']:14.1f}{row['tok_s'] / ip['tok_s']:14.0%}"
              f"{row['total_tok_s']:19.1f}")
    print("   goal: served >= 80 % of in-process tok/s at one stream:",
          "met" if s1["tok_s"] >= 0.8 * ip["tok_s"] else "NOT met")


def _peaks(r: dict) -> None:
    print("\n2. prefill peak per image size (MiB; estimate = G1's before / after a tower ran)")
    print(f"{'images':>14}{'tiles':>6}{'tokens':>7}{'MLX':>8}{'footpr.':>8}{'est.':>8}{'ratio':>7}"
          f"{'learned':>9}{'ratio':>7}")
    worst = []
    for row in r["peaks"]:
        cold, warm = row["rows"]
        mib = 2 ** 20
        print(f"{row['images']:>3} x {row['size']:>9}{cold['tiles']:>6}{cold['tokens']:>7}{cold['mlx_peak'] / mib:8.1f}"
              f"{cold['footprint'] / mib:8.1f}{cold['estimate'] / mib:8.1f}{cold['ratio']:7.2f}"
              f"{warm['estimate'] / mib:9.1f}{warm['ratio']:7.2f}")
        worst += [cold["ratio"], warm["ratio"]]
    print(f"   goal: 1.00 <= estimate / peak <= 1.25: {'met' if 1.0 <= min(worst) and max(worst) <= 1.25 else 'NOT met'}"
          f" (from {min(worst):.2f} to {max(worst):.2f})")


if __name__ == "__main__":
    main()
