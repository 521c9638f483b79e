"""Chaos scenarios against model swaps (SPEC W1, W2): scripts/chaos.py runs them beside the rest.

  spares         clients alternating two models, unloading between requests so every load takes
                 a spare, while spares are SIGKILLed and SIGSTOPped at random
  spare-squeeze  a spare holding a slow load (its weights read slowly) when the ceiling drops to
                 hard pressure: the load is aborted, its requests get a clear answer, nothing hangs
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from typing import Any

import httpx
from _chaos_harness import Row, Serve, base_config, classify, false_kills, one_stream, terminate

MiB = 1024 * 1024


def spare_pids(serve: Serve) -> list[int]:
    """Workers with no model, starting or waiting as spares (`/status`'s guard.workers)."""
    workers = serve.get("/status").json()["guard"]["workers"]
    return [w["pid"] for w in workers if not w["model"] and w["state"] in ("starting", "spare") and w.get("pid")]


async def _alternate(serve: Serve, row: Row, seconds: float, deadline: float = 60.0) -> None:
    """One client: a streamed chat to `a`, unload it, one to `b`, unload it ...: a load each time."""
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=serve.url, timeout=deadline + 5) as client:
        i = 0
        while time.monotonic() < end:
            model = "ab"[i % 2]
            await one_stream(client, model, row, deadline, max_tokens=8)
            try:
                classify(row, (await client.post(f"/v1/models/{model}/unload", json={})).status_code)
            except httpx.HTTPError:
                row.requests += 1
                row.hung += 1
            i += 1


def spares(ctx: Any) -> Row:
    row = Row("spares")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a, "b": ctx.model_b}, pinned=False, spare_workers=1),
                  ctx.runtime("sp")).start()
    stopped: set[int] = set()
    killed = paused = 0
    done = threading.Event()
    rng = random.Random(7)

    def torment() -> None:
        nonlocal killed, paused
        while not done.wait(rng.uniform(2.0, 4.0)):
            try:
                pids = spare_pids(serve)
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            if not pids:
                continue
            pid = rng.choice(pids)
            try:
                if rng.random() < 0.5:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                else:
                    os.kill(pid, signal.SIGSTOP)  # judged wedged and killed by the guard
                    stopped.add(pid)
                    paused += 1
            except ProcessLookupError:
                pass

    thread = threading.Thread(target=torment, daemon=True)
    try:
        serve.wait_healthy()
        thread.start()
        asyncio.run(_alternate(serve, row, ctx.seconds * 2))
    finally:
        done.set()
        thread.join(5)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        said = terminate(serve, row)
    row.false_kills = false_kills(serve.log_text(), stopped)
    takes = serve.log_text().count(" takes model ")
    row.note = (f"{takes} loads took a spare; {killed} spares SIGKILLed, {paused} SIGSTOPped; {said}")
    return row


def spare_squeeze(ctx: Any) -> Row:
    """A load in a spare whose weights read slowly (a test switch: 2 s per read) when the ceiling
    drops under what the group holds: P6 aborts the load; the request waiting on it gets a clear
    answer (a 503 or 507), and a later request loads the model again once the ceiling is back."""
    row = Row("spare-squeeze")
    config = base_config({"a": ctx.model_a, "big": ctx.model_big}, pinned=False, spare_workers=1)
    serve = Serve(ctx.work, config, ctx.runtime("ss"), env={"MEMVISOR_TEST_READ_DELAY": "2"}).start()
    rounds = aborted = 0
    try:
        serve.wait_healthy()
        with httpx.Client(base_url=serve.url, timeout=60) as client:
            for _ in range(3 if ctx.quick else 6):
                deadline = time.monotonic() + 30
                while not spare_pids(serve) and time.monotonic() < deadline:
                    time.sleep(0.2)  # a spare is made in the quiet after the last request
                guard = serve.get("/status").json()["guard"]
                waiting = threading.Thread(target=lambda: _load(client, row))
                waiting.start()
                time.sleep(1.0)  # the spare has the model and is reading it
                squeeze = {"tier": "custom", "custom_ceiling": max(MiB, int(guard["usage"] * 0.5))}
                classify(row, client.post("/admin/guard", json=squeeze).status_code)
                time.sleep(1.5)
                classify(row, client.post("/admin/guard", json={"tier": guard["tier"]}).status_code)
                waiting.join(90)
                rounds += 1
                classify(row, client.post("/v1/models/big/unload", json={}).status_code)
        aborted = serve.log_text().count("abort")
    finally:
        said = terminate(serve, row)
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = f"{rounds} rounds of a slow spare load squeezed to hard pressure; {aborted} abort lines; {said}"
    return row


def _load(client: httpx.Client, row: Row) -> None:
    try:
        r = client.post("/v1/chat/completions", json={"model": "big", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        classify(row, r.status_code)
    except httpx.HTTPError:
        row.requests += 1
        row.hung += 1


SCENARIOS = {"spares": spares, "spare-squeeze": spare_squeeze}
