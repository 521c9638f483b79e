"""Chaos scenarios from the browser, the half-sent request, the slow disk and the hostile file:
cross-site, slow-loris, slow-reload and hostile-files. scripts/chaos.py runs them beside the
rest; its docstring says what each does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _chaos_harness import (
    Context,
    Row,
    Serve,
    base_config,
    children,
    classify,
    clients,
    false_kills,
    proc_counts,
    rss_kib,
    terminate,
)

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
