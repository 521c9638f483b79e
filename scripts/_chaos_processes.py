"""Chaos scenarios against the processes: stream-kill, long-steps, obedience, sup-kill, respawn and
slow-subs (workers and the supervisor killed, stopped, slowed or flooded by readers that never
read). scripts/chaos.py runs them beside the rest; its docstring says what each does.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import zmq
from _chaos_harness import (
    ROOT,
    Context,
    Row,
    Serve,
    alive,
    base_config,
    clients,
    false_kills,
    proc_counts,
)

from supervisor.wiring.bus import Endpoints


def stream_kill(ctx: "Context") -> Row:
    row = Row("stream-kill")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a, "b": ctx.model_b}), ctx.runtime("sk")).start()
    stopped: set[int] = set()
    kills = 0
    try:
        serve.wait_healthy()

        async def killer() -> None:
            nonlocal kills
            end = time.monotonic() + ctx.seconds
            rng = random.Random(16)
            while time.monotonic() < end:
                await asyncio.sleep(rng.uniform(2.0, 4.0))
                pids = await asyncio.to_thread(serve.worker_pids)
                if not pids:
                    continue
                pid = rng.choice(sorted(pids.values()))
                sig = signal.SIGSTOP if rng.random() < 0.33 else signal.SIGKILL
                if sig == signal.SIGSTOP:
                    stopped.add(pid)
                try:
                    os.kill(pid, sig)
                    kills += 1
                except ProcessLookupError:
                    pass

        async def main() -> None:
            await asyncio.gather(clients(serve, ["a", "b"], row, ctx.seconds), killer())

        asyncio.run(main())
    finally:
        serve.stop()
    row.false_kills = false_kills(serve.log_text(), stopped)
    row.note = f"{kills} signals ({len(stopped)} SIGSTOP) over {ctx.seconds:.0f} s, 8 clients"
    return row


def long_steps(ctx: "Context") -> Row:
    """Each step 2.5 s against a 1.5 s heartbeat window (the worker's test-only delay
    sleeps with the GIL released, as MLX does): without the heartbeat thread every one was a kill."""
    row = Row("long-steps")
    config = base_config({"a": ctx.model_a}, heartbeat_timeout=1.5, heartbeat_interval=0.2)
    serve = Serve(ctx.work, config, ctx.runtime("ls"), env={"MEMVISOR_TEST_STEP_DELAY": "2.5"}).start()
    try:
        serve.wait_healthy()
        asyncio.run(clients(serve, ["a"], row, min(ctx.seconds, 20.0), n=3, deadline=90.0, max_tokens=3))
    finally:
        serve.stop()
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = "every step 2.5 s, heartbeat window 1.5 s"
    return row


def obedience(ctx: "Context") -> Row:
    """Ping round trips while a long prompt prefills, with chunks sized by time
    (chunk_seconds 1.0) and by memory only (0): the bound a command waits."""
    row = Row("obedience")
    results = {}
    for chunk_seconds in (1.0, 0.0):
        results[chunk_seconds] = asyncio.run(_obedience_run(ctx, chunk_seconds, row))
    timed, untimed = results[1.0], results[0.0]
    row.note = (f"max ping during prefill: {timed[0]:.2f} s timed (chunk_seconds 1), "
                f"{untimed[0]:.2f} s by memory only; prefill {timed[1]:.1f} s vs {untimed[1]:.1f} s")
    ctx.figures["obedience_max_ping_s"] = timed[0]
    ctx.figures["obedience_max_ping_untimed_s"] = untimed[0]
    return row


async def _obedience_run(ctx: "Context", chunk_seconds: float, row: Row) -> tuple[float, float]:
    from shared import protocol as p
    from supervisor.arbiter import Arbiter
    from supervisor.config_file import parse_config

    config = parse_config(base_config({"big": ctx.model_big}, pinned=False, chunk_seconds=chunk_seconds,
                                      heartbeat_timeout=30.0))
    arb = Arbiter(config, ctx.runtime(f"ob{int(chunk_seconds)}"), max_workers=4, http=False)
    task = asyncio.get_running_loop().create_task(arb.run())
    try:
        while not arb.running:
            if task.done():
                task.result()  # it failed to start: say why rather than wait for ever
            await asyncio.sleep(0.01)
        handle = await arb.models.load("big")
        # a prompt of each run's own from its first word: the timed run's KV, written to the
        # disk tier at its stop, must not let the second run skip its prefill (H5)
        prompt = f"run{int(chunk_seconds)} " + " ".join(f"w{i % 97}" for i in range(ctx.prompt_words))
        row.requests += 1
        stream = await arb.service.generate("big", p.Generate(request_id=f"ob{chunk_seconds}", prompt=prompt, max_tokens=2))
        started = time.monotonic()
        worst = 0.0
        while stream.queue.empty():
            worst = max(worst, await arb.pool.watchdog.ping(handle, timeout=120))
        first = await stream.queue.get()
        prefill = time.monotonic() - started
        while not isinstance(first, (p.Finished, p.Failed)):
            first = await stream.queue.get()
        if isinstance(first, p.Finished):
            row.finished += 1
        else:
            row.clear += 1
            row.note = first.message
        return worst, prefill
    finally:
        arb.stop()
        await asyncio.wait_for(task, 60)


def sup_kill(ctx: "Context") -> Row:
    row = Row("sup-kill")
    runtime = ctx.runtime("sup")
    config = base_config({"a": ctx.model_a, "b": ctx.model_b})
    rounds = 2 if ctx.quick else 5
    for _ in range(rounds):
        serve = Serve(ctx.work, config, runtime).start()
        serve.wait_healthy()
        pids = list(serve.worker_pids().values())
        assert serve.proc is not None
        serve.proc.kill()
        serve.proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.05)
        row.orphans += sum(1 for pid in pids if alive(pid))
        row.requests += 1
        serve.log.close()
    serve = Serve(ctx.work, config, runtime).start()  # the same runtime dir serves again
    serve.wait_healthy()
    row.finished = rounds
    serve.stop()
    row.note = f"{rounds} supervisor SIGKILLs, restarted on the same runtime dir each time"
    return row


def respawn(ctx: "Context") -> Row:
    row = Row("respawn")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a}), ctx.runtime("rs")).start()
    try:
        serve.wait_healthy()
        assert serve.proc is not None
        sup = serve.proc.pid
        warm = min(5, ctx.cycles)
        done = 0
        before = proc_counts(sup)
        end = time.monotonic() + ctx.respawn_budget
        while done < ctx.cycles + warm and time.monotonic() < end:
            if done == warm:
                before = proc_counts(sup)
            old = serve.worker_pids()["a"]
            os.kill(old, signal.SIGKILL)
            while True:
                pid = serve.worker_pids().get("a", 0)
                if pid and pid != old and serve.get("/health").status_code == 200:
                    break
                time.sleep(0.02)
            done += 1
        time.sleep(1.0)  # let the last exit be reaped
        after = proc_counts(sup)
    finally:
        serve.stop()
    cycles = max(1, done - warm)
    row.requests = cycles
    row.finished = cycles
    per = {k: (after[k] - before[k]) / cycles for k in ("fds", "threads", "rss_kib")}
    row.leaks = f"{per['fds']:+.2f} fd {per['threads']:+.2f} thr {per['rss_kib']:+.0f} KiB zomb {after['zombies']}"
    row.note = f"{cycles} respawn cycles after {warm} warm-up: fds {before['fds']}->{after['fds']}, " \
               f"threads {before['threads']}->{after['threads']}, RSS {before['rss_kib']}->{after['rss_kib']} KiB"
    ctx.figures["respawn_cycles"] = cycles
    return row


def slow_subs(ctx: "Context") -> Row:
    row = Row("slow-subs")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a}), ctx.runtime("ss")).start()
    zctx = zmq.Context()
    subs = []
    try:
        serve.wait_healthy()
        assert serve.proc is not None
        endpoints = Endpoints.load(serve.runtime_dir)
        for _ in range(ctx.subscribers):
            sub = zctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.connect(endpoints.pub)
            subs.append(sub)  # never read
        rss_before = proc_counts(serve.proc.pid)["rss_kib"]
        drill = subprocess.run([sys.executable, "-m", "supervisor", "drill", "a", "--rate", "64MiB/s", "--to",
                                "128MiB", "--runtime-dir", str(serve.runtime_dir)], cwd=ROOT, capture_output=True,
                               text=True, timeout=30)
        asyncio.run(clients(serve, ["a"], row, min(ctx.seconds, 15.0), n=4))
        rss_after = proc_counts(serve.proc.pid)["rss_kib"]
        counters = serve.get("/status").json()["counters"]
    finally:
        for sub in subs:
            sub.close(0)
        zctx.term()
        serve.stop()
    row.false_kills = false_kills(serve.log_text(), set())
    row.leaks = f"RSS {rss_after - rss_before:+d} KiB"
    row.note = (f"{ctx.subscribers} subscribers that never read ({counters.get('pub_subscribers_refused', 0)} "
                f"connections refused past the cap of 64); drill rc {drill.returncode}")
    return row
