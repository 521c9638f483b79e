"""Chaos scenarios that send garbage through every door: http-fuzz (the HTTP bodies), zmq-fuzz
(the ZeroMQ frames) and configs (the config files). scripts/chaos.py runs them beside the rest;
its docstring says what each does.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import zmq
from _chaos_harness import (
    ROOT,
    Context,
    Row,
    Serve,
    base_config,
    false_kills,
    proc_counts,
)

from supervisor.wiring.bus import Endpoints


def hostile_bodies(rng: random.Random, n: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers): the named attacks, then random JSON of every shape."""
    chat = "/v1/chat/completions"
    named: list[tuple[str, bytes, dict[str, str]]] = [
        (chat, b'{"model":"a","messages":' + b"[" * 3000 + b"]" * 3000 + b"}", {}),
        ("/v1/completions", b'{"model":"a","prompt":' + b"[" * 3000 + b"]" * 3000 + b"}", {}),
        ("/v1/completions", json.dumps({"model": "a", "prompt": "w " * 200_000, "max_tokens": 4}).encode(), {}),
        (chat, json.dumps({"model": "a", "max_tokens": 1_000_000, "messages": [
            {"role": "user", "content": "hi"}]}).encode(), {}),
        (chat, json.dumps({"model": "a", "max_tokens": 99999999999999999999, "messages": []}).encode(), {}),
        (chat, b"\xff\xfe garbage", {}),
        (chat, b"", {}),
        (chat, json.dumps({"model": "a/load", "messages": [{"role": "user", "content": "x"}]}).encode(), {}),
        ("/admin/guard", json.dumps({"tier": "turbo"}).encode(), {}),
        ("/admin/guard", json.dumps({"custom_ceiling": "1e400GiB"}).encode(), {}),
        ("/v1/models/a%2Fload/load", b"", {}),
    ]
    scalars = [None, True, -1, 0, 2**70, 1e308, float("nan"), "", "a", "x" * 5000, "\u0000\udcff"]

    def value(depth: int):
        pick = rng.random()
        if depth > 3 or pick < 0.5:
            v = rng.choice(scalars)
            return str(v) if isinstance(v, float) and v != v else v
        if pick < 0.75:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["model", "messages", "prompt", "max_tokens", "stream", "role", "content",
                            "temperature", "stop", "seed", "n", "tools"]): value(depth + 1)
                for _ in range(rng.randint(0, 5))}

    fuzz: list[tuple[str, bytes, dict[str, str]]] = []
    for _ in range(n):
        extra = value(0)
        body = {"model": rng.choice(["a", "b", "nope", 5]), **(extra if isinstance(extra, dict) else {})}
        for key in ("messages", "prompt", "max_tokens", "stream", "temperature", "stop", "seed"):
            if rng.random() < 0.4:
                body[key] = value(1)
        fuzz.append((rng.choice([chat, "/v1/completions"]),
                     json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass"), {}))
    return named + fuzz


def http_fuzz(ctx: "Context") -> Row:
    row = Row("http-fuzz")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a, "b": ctx.model_b}, body_timeout=2.0),
                  ctx.runtime("hf")).start()
    try:
        serve.wait_healthy()
        bodies = hostile_bodies(random.Random(16), 60 if ctx.quick else 400)
        with httpx.Client(base_url=serve.url, timeout=90) as client:
            for path, body, headers in bodies:
                row.requests += 1
                try:
                    status = client.post(path, content=body, headers={"content-type": "application/json",
                                                                      **headers}).status_code
                except httpx.HTTPError:
                    row.hung += 1
                    continue
                if status == 200:
                    row.finished += 1
                elif status >= 500 and status != 503:
                    row.e5xx += 1
                else:
                    row.clear += 1
        row.requests += 1
        row.clear += _short_body(serve.port)
    finally:
        serve.stop()
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = "named attacks (nesting 3000, 200k-token prompt, max_tokens 10**6 and 10**20, short body) + random JSON"
    return row


def _short_body(port: int) -> int:
    """A body shorter than its Content-Length: 1 when a 408 comes back within 10 s."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        try:
            return int(sock.recv(64).startswith(b"HTTP/1.1 408"))
        except TimeoutError:
            return 0


def zmq_fuzz(ctx: "Context") -> Row:
    row = Row("zmq-fuzz")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a}), ctx.runtime("zf")).start()
    try:
        serve.wait_healthy()
        assert serve.proc is not None
        endpoints = Endpoints.load(serve.runtime_dir)
        warnings_before = serve.log_text().count("refused a frame")
        rss_before = proc_counts(serve.proc.pid)["rss_kib"]
        frames = ctx.zmq_frames
        worst = asyncio.run(_flood(endpoints, frames, serve))
        time.sleep(1.0)
        rss_after = proc_counts(serve.proc.pid)["rss_kib"]
        lines = serve.log_text().count("refused a frame") - warnings_before
        status = serve.get("/status").json()
    finally:
        serve.stop()
    row.requests = frames
    row.clear = status["malformed_frames"]
    row.leaks = f"RSS {rss_after - rss_before:+d} KiB"
    row.note = f"{frames} distinct garbage frames: {lines} log lines, /health worst {worst * 1000:.0f} ms during the flood"
    return row


async def _flood(endpoints: Endpoints, frames: int, serve: Serve) -> float:
    import msgspec

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoints.reports)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"chaos-intruder")
    dealer.connect(endpoints.commands)
    worst = 0.0

    async def probe() -> None:
        nonlocal worst
        async with httpx.AsyncClient(base_url=serve.url, timeout=30) as client:
            for _ in range(20):
                started = time.monotonic()
                await client.get("/health")
                worst = max(worst, time.monotonic() - started)
                await asyncio.sleep(0.1)

    prober = asyncio.ensure_future(probe())
    for i in range(frames):
        frame = msgspec.msgpack.encode({"type": f"Evil{i}", "v": 1 + (i % 3) * 1000 + i, "x": i})
        sock = push if i % 2 else dealer
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:
                await asyncio.sleep(0.001)
        if i % 500 == 0:
            await asyncio.sleep(0)
    await prober
    push.close(0)
    dealer.close(0)
    ctx.term()
    return worst


BROKEN_CONFIGS = {
    "max_concurrency 1e20": '[[models]]\nid = "a"\npath = "{a}"\nmax_concurrency = 99999999999999999999',
    "heartbeat_interval 1e-9": '[supervisor]\nheartbeat_interval = 1e-9',
    "poll_interval 1e-9": '[guard]\npoll_interval = 1e-9',
    "tier turbo": '[guard]\ntier = "turbo"',
    "soft_threshold -0.5": '[guard]\nsoft_threshold = -0.5',
    "missing path": '[[models]]\nid = "a"\npath = "{missing}"',
    "path is a file": '[[models]]\nid = "a"\npath = "{file}"',
    "id a/load": '[[models]]\nid = "a/load"\npath = "{a}"',
    "unknown key": '[supervisor]\nheartbeat = 1',
}


def configs(ctx: "Context") -> Row:
    row = Row("configs")
    afile = ctx.work / "not-a-model.bin"
    afile.write_bytes(b"x")
    for name, text in BROKEN_CONFIGS.items():
        path = ctx.work / f"broken-{len(name)}-{row.requests}.toml"
        path.write_text(text.format(a=ctx.model_a, missing=ctx.work / "absent", file=afile))
        row.requests += 1
        try:
            done = subprocess.run([sys.executable, "-m", "supervisor", "serve", "--config", str(path),
                                   "--runtime-dir", str(ctx.runtime("cf")), "--http", "127.0.0.1:0"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            row.hung += 1  # accepted: it served (a value that parses but breaks the system)
            continue
        if done.returncode == 2 and "configuration error" in done.stderr and "Traceback" not in done.stderr:
            row.clear += 1
        else:
            row.e5xx += 1
            print(f"config {name!r}: rc {done.returncode}: {done.stderr[-500:]}", file=sys.stderr)
    row.note = ", ".join(BROKEN_CONFIGS)
    return row
