"""What reporting the real `input_tokens` in Anthropic's streamed `message_start` costs.
It first cost a one-token counting generation before every streamed
/v1/messages request (a second prefill unless the prompt cache served it: 1.37x the
chat TTFT with the cache on, 1.91x off); now the worker's `Prompted` message carries
the count before the first token, and the ratio should be ~1.0 either way.

    python scripts/bench_count_first.py [--size 8MiB] [--words 400] [--rounds 5]

Two supervisors (`python -m supervisor serve`, real HTTP, a worker each) on the same
generated model: one with `[guard] hot_cache_max = 1GiB` (the default-on prompt
cache), one with `hot_cache_max = 0`. Each round sends a fresh prompt (new words, so
no earlier request is cached) as a streamed /v1/chat/completions and as a streamed
/v1/messages, alternating which goes first; time to first text is request sent ->
first token event. The figures are ratios within one run (a shared, noisy machine).

    count-first: /v1/messages TTFT / chat TTFT = X (prompt cache on), Y (off)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _serve import ServeProcess, bench_model  # noqa: E402

from shared.sizes import parse_size  # noqa: E402

WORDS = "memory pressure guard worker model cache prefix token budget ceiling supervisor prefill".split()


def ttft(base: str, path: str, body: dict) -> float:
    import httpx

    with httpx.Client(timeout=600) as client:
        sent = time.perf_counter()
        with client.stream("POST", base + path, json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"{path}: HTTP {r.status_code}: {r.read().decode()}")
            for line in r.iter_lines():
                # the first text, or the end when a reply has none (an empty first token, EOS)
                if line.startswith("data: ") and ('"text_delta"' in line or '"message_delta"' in line
                                                  or '"content":"' in line and '"content":""' not in line
                                                  or '"finish_reason":"' in line):
                    return time.perf_counter() - sent
    raise SystemExit(f"{path}: no token came")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8MiB")
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model = bench_model(f"bench-{parse_size(args.size)}-float32-seed0", parse_size(args.size), 0, "float32")
    rng = random.Random(0)
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, guard in (("on", "hot_cache_max = \"1GiB\""), ("off", "hot_cache_max = 0")):
            body = (f"[guard]\n{guard}\n[supervisor]\nheartbeat_timeout = 120\n"
                    f'[[models]]\nid = "m"\npath = "{model}"\npinned = true\n')
            server = ServeProcess(body, config=Path(tmp) / f"{name}.toml", runtime=Path(tmp) / f"rt-{name}",
                                  log=Path(tmp) / f"{name}.log", timeout=300.0, stop_grace=60.0)
            try:
                chat, messages = [], []
                for i in range(args.rounds + 1):
                    def prompt() -> list[dict]:
                        return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(args.words))}]
                    c = ("/v1/chat/completions", {"model": "m", "messages": prompt(), "max_tokens": 2,
                                                  "temperature": 0, "stream": True})
                    a = ("/v1/messages", {"model": "m", "messages": prompt(), "max_tokens": 2, "stream": True})
                    pair = (c, a) if i % 2 else (a, c)
                    times = {path: ttft(server.base, path, b) for path, b in pair}
                    if i:  # the first round warms the worker
                        chat.append(times["/v1/chat/completions"])
                        messages.append(times["/v1/messages"])
                ratios[name] = statistics.median(messages) / statistics.median(chat)
                print(json.dumps({"prompt_cache": name, "chat_ttft_ms": [round(t * 1000) for t in chat],
                                  "messages_ttft_ms": [round(t * 1000) for t in messages]}), flush=True)
            finally:
                server.close()
    print(f"count-first: /v1/messages TTFT / chat TTFT = {ratios['on']:.2f} (prompt cache on), "
          f"{ratios['off']:.2f} (off)")


if __name__ == "__main__":
    main()
