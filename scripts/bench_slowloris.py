"""Slow-loris against a real `serve`: does /health keep answering, and does SIGTERM stop it?

Starts `python -m supervisor serve` with no models on a free loopback port,
opens N connections that send a request line and then one header byte every
second, never the blank line, and meanwhile asks /health once a second. Prints
how many of the slow connections the server has closed, /health's status and
latency, the server's open descriptors, its log size, and how long SIGTERM
takes to stop it.

    python scripts/bench_slowloris.py [--connections 3000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--header-timeout", type=float, help="[supervisor] header_timeout (default: the server's)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="slowloris-"))
    extra = f"header_timeout = {args.header_timeout}\n" if args.header_timeout else ""
    (tmp / "m.toml").write_text(f'[supervisor]\nhttp = "127.0.0.1:0"\n{extra}')
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(  # the server starts with this shell's soft open-file limit
[sys.executable, "-m", "supervisor", "serve", "--config", str(tmp / "m.toml"),
                             "--runtime-dir", str(tmp / "rt")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = ""
        for _ in range(600):
            try:
                address = json.loads((tmp / "rt" / "endpoints.json").read_text()).get("http", "")
            except (OSError, ValueError):
                pass
            if address and not address.endswith(":0"):
                break
            time.sleep(0.05)
        host, port = address.rsplit(":", 1)
        url = f"http://{address}"
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the client's own sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 256), hard))
        socks: list[socket.socket] = []
        refused = 0
        for _ in range(args.connections):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect_ex((host, int(port)))
            except OSError:
                refused += 1
                continue
            socks.append(s)
        time.sleep(0.5)
        for s in socks:
            try:
                s.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                pass
        me = psutil.Process(proc.pid)
        start = time.monotonic()
        print(f"{len(socks)} slow connections opened ({refused} failed locally)")
        print(" t(s)  open-on-server  fds  /health  latency(ms)  log(KB)")
        while time.monotonic() - start < args.seconds:
            for s in socks:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            t0 = time.monotonic()
            try:
                status = str(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            latency = (time.monotonic() - t0) * 1000
            established = sum(1 for c in me.net_connections("tcp")
                              if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == int(port))
            print(f"{time.monotonic() - start:5.1f}  {established:14d}  {me.num_fds():4d}  {status:>7}  "
                  f"{latency:11.1f}  {os.path.getsize(tmp / 'serve.log') / 1024:7.1f}")
            time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
            print(f"SIGTERM: exited with {proc.returncode} after {time.monotonic() - t0:.2f} s")
        except subprocess.TimeoutExpired:
            print("SIGTERM: still running after 30 s")
        for s in socks:
            s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
