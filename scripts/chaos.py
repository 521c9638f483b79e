"""Chaos suite: abuse a real supervisor and count what it costs.

Every scenario runs real processes on this machine, over loopback and ipc
only, bounded in time and count:

  stream-kill     streaming clients while workers are SIGKILLed and SIGSTOPped
  long-steps      every engine step longer than the heartbeat window (no kill may follow)
  obedience       how long a command waits for a step boundary during a long prefill
  sup-kill        the supervisor SIGKILLed and restarted on the same runtime dir
  respawn         workers SIGKILLed over and over: fd/thread/RSS/zombie counts per cycle
  http-fuzz       random and hostile HTTP bodies (nesting, sizes, context, short bodies)
  zmq-fuzz        distinct garbage frames on the ZeroMQ sockets
  configs         configs that used to break the system at run time
  slow-subs       subscribers that never read, during a fire drill
  cross-site      a web page's POSTs (text/plain, foreign Origin) and DNS-rebinding Host headers
  slow-loris      connections whose headers never end, past the descriptor limit; /health, SIGTERM
  slow-reload     SIGHUP over a models folder of many thousands of empty folders, streams running
  hostile-files   a FIFO as model.safetensors, a sparse multi-GB config.json, GGUFs that lie
  kv-attacks      a user's files and links under kv/, an evicting budget, a NaN and a wrong-shape entry
  shared-root     a caches folder others could write, made before the server
  key-probe       one API key guessing another's secret from cached-token counts (memory, disk)
  plain-unload    an ordinary key unloading a pinned model through Ollama's keep_alive 0
  spares          every load taking a spare while spares are SIGKILLed and SIGSTOPped
  spare-squeeze   a spare's slow load when the ceiling drops to hard pressure

and prints one table; the last line is the headline:

  chaos: N requests, H hung, F false kills, E 5xx, O orphans, X changed from a foreign origin,
         T files outside the tier touched, K cross-key hits

    python scripts/chaos.py [--quick] [--only SCENARIO ...] [--cycles N] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chaos_swap as swap  # noqa: E402
import chaos_trust as trust  # noqa: E402
from _chaos_harness import (  # noqa: E402  (scripts/ is on sys.path as the script's folder)
    MiB,
    Row,
    Serve,
    alive,
    base_config,
    children,
    classify,
    clients,
    false_kills,
    proc_counts,
    rss_kib,
    terminate,
)

from supervisor.wiring.bus import Endpoints  # noqa: E402

# ---------------------------------------------------------------------------
# scenarios


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


# ---------------------------------------------------------------------------
# the browser, the half-sent request, the slow disk, the hostile file

FOREIGN = "http://evil.example"



def _guard_state(serve: Serve) -> tuple:
    """What a cross-site attack could change: the guard's settings and what is loaded."""
    st = serve.get("/status").json()
    g = st["guard"]
    return (g["enabled"], g["tier"], g.get("custom_ceiling")), tuple(sorted(
        (m["id"], bool(m.get("pid"))) for m in st["models"]))


# (what, method, path, body, headers); {host} is this server's 127.0.0.1:PORT
CROSS_SITE: list[tuple[str, str, str, bytes, dict[str, str]]] = [
    ("text/plain guard off from a foreign Origin", "POST", "/admin/guard", b'{"enabled": false}',
     {"content-type": "text/plain", "origin": FOREIGN}),
    ("form-encoded guard off from a foreign Origin", "POST", "/admin/guard", b'{"enabled": false}',
     {"content-type": "application/x-www-form-urlencoded", "origin": FOREIGN}),
    ("JSON tier change from a foreign Origin", "POST", "/admin/guard", b'{"tier": "safe"}',
     {"content-type": "application/json", "origin": FOREIGN}),
    ("text/plain guard off with no Origin", "POST", "/admin/guard", b'{"enabled": false}',
     {"content-type": "text/plain"}),
    ("rebinding Host: tier change", "POST", "/admin/guard", b'{"tier": "safe"}',
     {"content-type": "application/json", "host": "evil.example:{port}", "origin": "http://evil.example:{port}"}),
    ("rebinding Host: guard off, no Origin", "POST", "/admin/guard", b'{"enabled": false}',
     {"content-type": "application/json", "host": "evil.example:{port}"}),
    ("text/plain unload from a foreign Origin", "POST", "/v1/models/b/unload", b"{}",
     {"content-type": "text/plain", "origin": FOREIGN}),
    ("rebinding Host: unload", "POST", "/v1/models/b/unload", b"{}",
     {"content-type": "application/json", "host": "evil.example:{port}"}),
    ("rebinding Host reads /status", "GET", "/status", b"", {"host": "evil.example:{port}"}),
    ("rebinding Host reads /metrics", "GET", "/metrics", b"", {"host": "evil.example:{port}"}),
]


def cross_site(ctx: "Context") -> Row:
    """A web page's requests: state changes from a foreign Origin (text/plain needs no preflight)
    and a DNS-rebinding Host. `foreign` counts each that changed the guard or what is loaded,
    or read state under a foreign Host."""
    row = Row("cross-site")
    config = base_config({"a": ctx.model_a}) + f'[[models]]\nid = "b"\npath = "{ctx.model_b}"\n'
    serve = Serve(ctx.work, config, ctx.runtime("xs")).start()
    got = []
    try:
        serve.wait_healthy()
        with httpx.Client(base_url=serve.url, timeout=30) as client:
            client.post("/v1/models/b/load", json={})  # the unload attacks need it loaded
            for what, method, path, body, headers in CROSS_SITE:
                before = _guard_state(serve)
                sent = {k: v.format(port=serve.port) for k, v in headers.items()}
                try:
                    response = client.request(method, path, content=body or None, headers=sent)
                except httpx.HTTPError:
                    row.requests += 1
                    row.hung += 1
                    continue
                classify(row, response.status_code)
                changed = _guard_state(serve) != before
                read = method == "GET" and response.status_code == 200
                if changed or read:
                    row.foreign += 1
                    got.append(what)
                if changed:  # put it back, as the machine's own user
                    client.post("/admin/guard", json={"enabled": before[0][0], "tier": before[0][1]})
                    client.post("/v1/models/b/load", json={})
    finally:
        said = terminate(serve, row)
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = (f"{len(CROSS_SITE)} attacks, through: {', '.join(got)}" if got else
                f"{len(CROSS_SITE)} attacks (foreign Origin, text/plain, rebinding Host), none through") + f"; {said}"
    return row


def slow_loris(ctx: "Context") -> Row:
    """Connections whose headers never end, more than the supervisor has descriptors
    (RLIMIT_NOFILE 256 here); meanwhile /health every 0.5 s, a worker SIGKILLed halfway
    (must be reaped and respawned), then SIGTERM with every connection still open."""
    import socket

    row = Row("slow-loris")
    serve = Serve(ctx.work, base_config({"a": ctx.model_a}), ctx.runtime("sl"), nofile=256).start()
    socks: list[socket.socket] = []
    health = healthy = closed = zombies = log_growth = 0
    respawned: list[int] = []
    try:
        serve.wait_healthy()
        assert serve.proc is not None
        worker = serve.worker_pids()["a"]
        log_before = serve.log_path.stat().st_size
        for _ in range(ctx.loris):
            try:
                sock = socket.create_connection(("127.0.0.1", serve.port), timeout=2)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                sock.setblocking(False)
                socks.append(sock)
            except OSError:
                break
        started = time.monotonic()
        seconds = 15.0 if ctx.quick else 25.0  # past the default header_timeout (10 s)
        killed = False
        old = children(serve.proc.pid)  # the worker and its helpers (a resource tracker)
        while time.monotonic() - started < seconds:
            health += 1
            try:
                status = httpx.get(serve.url + "/health", timeout=3).status_code
                healthy += status == 200
                classify(row, status)
            except httpx.HTTPError:
                row.requests += 1
                row.hung += 1
            for sock in list(socks):  # a byte now and then: a per-read timeout alone never fires
                try:
                    sock.send(b"a")
                    if sock.recv(64, socket.MSG_PEEK) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
                    socks.remove(sock)
                    sock.close()
            if not killed and time.monotonic() - started > seconds / 2:
                os.kill(worker, signal.SIGKILL)  # its exit must be reaped, and it respawned (pinned)
                killed = True
            time.sleep(0.5)
        zombies = proc_counts(serve.proc.pid)["zombies"]
        respawned = [pid for pid in children(serve.proc.pid) if pid not in old]
        log_growth = serve.log_path.stat().st_size - log_before
    finally:
        said = terminate(serve, row)
        for sock in socks:
            sock.close()
    row.false_kills = false_kills(serve.log_text(), set())
    row.leaks = f"zomb {zombies} log +{log_growth // 1024} KiB"
    row.note = (f"{len(socks) + closed} connections with endless headers ({closed} closed by the server), "
                f"/health 200 {healthy}/{health}; worker SIGKILLed: {'respawned' if respawned else 'NOT respawned'}; "
                f"{said}")
    return row


def slow_reload(ctx: "Context") -> Row:
    """SIGHUP with a models folder of many thousands of empty folders, a pinned worker
    serving streams meanwhile: the rescan must not stall the loop into a mass 'wedged' kill."""
    import shutil

    row = Row("slow-reload")
    shm = Path("/dev/shm")  # tmpfs: making and removing 150k folders on a disk takes minutes
    folder = Path(tempfile.mkdtemp(prefix="memvisor-chaos-many-", dir=shm if shm.is_dir() else ctx.work))
    config = base_config({"a": ctx.model_a}, models_dirs=[str(folder)], heartbeat_timeout=2.0)
    serve = Serve(ctx.work, config, ctx.runtime("sr")).start()
    worst = 0.0
    try:
        serve.wait_healthy()
        assert serve.proc is not None
        made = time.monotonic()
        for i in range(ctx.empty_folders):
            (folder / f"empty-{i:06d}").mkdir()
        made = time.monotonic() - made

        async def main() -> None:
            nonlocal worst

            async def hup_and_probe() -> None:
                nonlocal worst
                await asyncio.sleep(1.0)
                assert serve.proc is not None
                serve.proc.send_signal(signal.SIGHUP)
                async with httpx.AsyncClient(base_url=serve.url, timeout=30) as client:
                    end = time.monotonic() + 10
                    while time.monotonic() < end:
                        t0 = time.monotonic()
                        try:
                            await client.get("/health")
                        except httpx.HTTPError:
                            row.hung += 1
                        worst = max(worst, time.monotonic() - t0)
                        await asyncio.sleep(0.2)

            await asyncio.gather(clients(serve, ["a"], row, 12.0, n=2, deadline=60.0), hup_and_probe())

        asyncio.run(main())
    finally:
        said = terminate(serve, row)
        shutil.rmtree(folder, ignore_errors=True)
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = (f"SIGHUP over {ctx.empty_folders} empty folders (made in {made:.0f} s), heartbeat window 2 s: "
                f"/health worst {worst:.2f} s; {said}")
    return row


def _hostile_folder(ctx: "Context", root: Path, fifo: bool) -> dict[str, str]:
    """Files that are not what they say in the models folder `root`: the FIFO alone
    (`fifo`), else the sparse ones and the liar. Returns each model's id and what it is."""
    import shutil
    import struct

    if fifo:
        folder = root / "fifo-model"
        folder.mkdir(exist_ok=True)
        shutil.copy(ctx.model_a / "config.json", folder / "config.json")
        if not (folder / "model.safetensors").exists():  # (--keep: a second run finds it)
            os.mkfifo(folder / "model.safetensors")
        return {"fifo-model": "FIFO as model.safetensors"}
    sparse = root / "sparse-config"
    sparse.mkdir(exist_ok=True)
    shutil.copy(ctx.model_a / "model.safetensors", sparse / "model.safetensors")
    with open(sparse / "config.json", "wb") as f:
        f.write(b'{"model_type": "llama", "pad": "')
        f.truncate(ctx.sparse_bytes)  # zeros the disk does not hold
    with open(root / "sparse.gguf", "wb") as f:  # a GGUF v3 header, then gigabytes of nothing
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1))
        f.truncate(ctx.sparse_bytes)
    with open(root / "liar.gguf", "wb") as f:  # 4 KiB that claim 2**40 tensors and 2**40 keys
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40))
        f.write(struct.pack("<Q", 1 << 40) + b"k" * 64)
        f.truncate(4096)
    gib = ctx.sparse_bytes / (1 << 30)
    return {"sparse-config": f"{gib:g} GiB sparse config.json", "sparse": f"{gib:g} GiB sparse GGUF",
            "liar": "4 KiB GGUF claiming 2**40 entries"}


def hostile_files(ctx: "Context") -> Row:
    """A models folder that a reload finds full of files that are not what they say (first the
    sparse ones and the liar, then a FIFO); after each reload /v1/models, /status and a load of
    each: the loop must keep answering, stay small, and stop on SIGTERM."""
    import threading

    row = Row("hostile-files")
    folder = ctx.work / "hostile"
    folder.mkdir(exist_ok=True)
    serve = Serve(ctx.work, base_config({"a": ctx.model_a}, models_dirs=[str(folder)]), ctx.runtime("hf")).start()
    peak = worker_peak = 0
    runaway: list[str] = []
    done = threading.Event()

    def watch_rss() -> None:  # a runaway read must not take the shared machine with it
        nonlocal peak, worker_peak
        assert serve.proc is not None
        while not done.is_set():
            for pid in [serve.proc.pid, *children(serve.proc.pid)]:
                rss = rss_kib(pid)
                if pid == serve.proc.pid:
                    peak = max(peak, rss)
                else:
                    worker_peak = max(worker_peak, rss)
                if rss > 3 * 1024 * 1024:
                    runaway.append("the supervisor" if pid == serve.proc.pid else f"worker {pid}")
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_rss, daemon=True)
    said = ""
    kinds: dict[str, str] = {}
    base = unsent = said_refused = 0
    try:
        serve.wait_healthy()
        assert serve.proc is not None
        base = rss_kib(serve.proc.pid)
        watcher.start()
        with httpx.Client(base_url=serve.url, timeout=30) as client:  # a load may take a while; /health may not
            for fifo in (False, True):
                found = _hostile_folder(ctx, folder, fifo)
                kinds.update(found)
                serve.proc.send_signal(signal.SIGHUP)
                time.sleep(1.0)
                requests: list[tuple[str, str, dict | None]] = [("GET", "/health", None), ("GET", "/v1/models", None),
                                                                ("GET", "/status", None)]
                requests += [("POST", f"/v1/models/{name}/load", {}) for name in found]
                requests += [("POST", "/v1/chat/completions", {"model": "a", "max_tokens": 4, "messages": [
                    {"role": "user", "content": "hi"}]}), ("GET", "/health", None)]
                for i, (method, path, body) in enumerate(requests):
                    try:
                        status = client.request(method, path, json=body, timeout=30 if body is not None else 5)
                        classify(row, status.status_code)
                        if status.status_code == 404 and "were refused" in status.text:
                            said_refused += 1  # no model, and the 404 says why
                        if status.status_code >= 500 and status.status_code != 503:
                            print(f"   hostile-files: {path}: {status.status_code} {status.text[:300]}", file=sys.stderr)
                    except httpx.HTTPError:
                        row.requests += 1
                        row.hung += 1
                        unsent = len(requests) - i - 1  # a frozen loop answers none of the rest: bounded
                        break
                if unsent or serve.proc.poll() is not None:
                    break
    finally:
        done.set()
        said = terminate(serve, row)
    row.false_kills = false_kills(serve.log_text(), set())
    row.leaks = f"RSS peak +{max(0, peak - base) // 1024} MiB, worker {worker_peak // 1024} MiB" if peak else "-"
    frozen = f"; loop frozen: the next {unsent} requests not sent" if unsent else ""
    killed = f"; SIGKILLed past 3 GiB RSS: {', '.join(runaway)}" if runaway else ""
    refused = f"; {said_refused} of {len(kinds)} loads a 404 saying the files were refused"
    row.note = f"{', '.join(kinds.values()) or 'folder not built'}{refused}{frozen}{killed}; {said}"
    return row


SCENARIOS = {"stream-kill": stream_kill, "long-steps": long_steps, "obedience": obedience, "sup-kill": sup_kill,
             "respawn": respawn, "http-fuzz": http_fuzz, "zmq-fuzz": zmq_fuzz, "configs": configs,
             "slow-subs": slow_subs, "cross-site": cross_site, "slow-loris": slow_loris, "slow-reload": slow_reload,
             "hostile-files": hostile_files, **trust.SCENARIOS, **swap.SCENARIOS}


# ---------------------------------------------------------------------------


class Context:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.quick = args.quick
        self.work = work
        self.seconds = 10.0 if args.quick else args.seconds
        self.cycles = 10 if args.quick else args.cycles
        self.respawn_budget = 60.0 if args.quick else args.respawn_budget
        self.zmq_frames = 5_000 if args.quick else 100_000
        self.subscribers = 16 if args.quick else 100
        self.prompt_words = 600 if args.quick else 1500
        self.loris = 300 if args.quick else 600  # past the supervisor's 256 descriptors either way
        self.empty_folders = 60_000 if args.quick else 150_000
        self.sparse_bytes = (1 if args.quick else 2) << 30
        self.figures: dict[str, float] = {}
        self._n = 0
        self._private_cache(work / "cache")
        from modelfiles.modelgen import make_model

        models = work / "models"
        self.model_a, self.model_b, self.model_big = models / "a", models / "b", models / "big"
        make_model(self.model_a, 2 * MiB, 0)
        make_model(self.model_b, 2 * MiB, 1)
        make_model(self.model_big, (8 if args.quick else 16) * MiB, 2)

    @staticmethod
    def _private_cache(root: Path) -> None:
        """The supervisors started here, and their workers, keep their prompt cache's disk tier
        (H5) in this run's folder, not the user's: a stop in one scenario must not hand cached
        tokens to the next (obedience's prefills would be read back instead of computed), and
        the throwaway models must leave nothing behind. The BLAS copy is the user's (hard links)."""
        from shared.probe import blas_plan as found
        from worker import blas

        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        blas.preload()  # verifies (or writes) the user's copy, which the run's root then shares
        blas.share_copy(root)
        os.environ[found.CACHE_ENV] = str(root)

    def runtime(self, tag: str) -> Path:
        self._n += 1
        path = Path(tempfile.mkdtemp(prefix=f"mv{tag}{self._n}-", dir="/tmp"))  # ipc paths stay short
        path.chmod(0o700)
        return path


def table(rows: list[Row]) -> str:
    head = f"{'scenario':<13} {'requests':>8} {'finished':>8} {'clear':>6} {'hung':>5} {'5xx':>4} " \
           f"{'orphans':>7} {'false kills':>11} {'foreign':>7} {'touched':>7} {'x-key':>5}  {'leaks per cycle':<36} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.scenario:<13} {r.requests:>8} {r.finished:>8} {r.clear:>6} {r.hung:>5} {r.e5xx:>4} "
                     f"{r.orphans:>7} {r.false_kills:>11} {r.foreign:>7} {r.touched:>7} {r.cross_key:>5}  "
                     f"{r.leaks:<36} {r.note}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute or two)")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run only these scenarios")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of the streaming scenarios")
    parser.add_argument("--cycles", type=int, default=300, help="respawn cycles (bounded by --respawn-budget)")
    parser.add_argument("--respawn-budget", type=float, default=180.0, help="seconds the respawn scenario may take")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep models, configs and serve logs in DIR")
    parser.add_argument("--json", type=Path, help="also write the rows and figures as JSON here")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("chaos.py reads /proc: Linux only", file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memvisor-chaos-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(args, work)
        for name in args.only or SCENARIOS:
            t0 = time.monotonic()
            print(f"-- {name} ...", file=sys.stderr, flush=True)
            rows.append(SCENARIOS[name](ctx))
            print(f"   {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "figures": ctx.figures,
                                         "wall_s": wall}, indent=2))
    total = sum(r.requests for r in rows if r.scenario not in ("zmq-fuzz", "respawn"))
    print(f"wall time {wall:.0f} s")
    print(f"chaos: {total} requests, {sum(r.hung for r in rows)} hung, {sum(r.false_kills for r in rows)} false kills, "
          f"{sum(r.e5xx for r in rows)} 5xx, {sum(r.orphans for r in rows)} orphans, "
          f"{sum(r.foreign for r in rows)} changed from a foreign origin, "
          f"{sum(r.touched for r in rows)} files outside the tier touched, {sum(r.cross_key for r in rows)} cross-key hits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
