"""Real processes for the `chat` and `pull` live tests (no tests here).

- `Serving`: `python -m supervisor serve --config FILE` in its own process, its front door's
  URL read from the runtime dir once it listens.
- `Terminal`: a command on a pseudo-terminal (`pty`), driven as a person would: wait for
  text, type a line, read what came back, Ctrl-C, Ctrl-D.
- `RecordingProxy`: forwards every request to a real front door and keeps the `/api/chat`
  bodies, so a test can see what a chat sent (its history) while the answers stay real.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.process_harness import sigterm_then_kill

ROOT = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


class Serving:
    """`serve --config` with `toml`; `url` and `runtime_dir` once it listens."""

    def __init__(self, toml: str, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.runtime_dir = folder / "rt"
        (folder / "memvisor.toml").write_text(toml)
        self.log_path = folder / "serve.log"
        self.url = ""

    def __enter__(self) -> "Serving":
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config",
                                      str(self.folder / "memvisor.toml"), "--runtime-dir", str(self.runtime_dir)],
                                     cwd=ROOT, env=cli_env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            address = self._address()
            if address and not address.endswith(":0"):
                self.url = "http://" + address.replace("0.0.0.0", "127.0.0.1")
                return self
            time.sleep(0.1)
        raise AssertionError("the front door did not listen within 90 s")

    def _address(self) -> str:
        try:
            return json.loads((self.runtime_dir / "endpoints.json").read_text()).get("http", "")
        except (OSError, ValueError):
            return ""

    def __exit__(self, *exc) -> None:
        sigterm_then_kill(self.proc)
        self.log.close()


class Terminal:
    """`argv` on a pseudo-terminal: what it printed so far in `output`."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, with the pty as its terminal
            os.chdir(ROOT)
            os.execve(argv[0], argv, env)
        self.raw = b""
        self.read_to = 0  # what `expect` has consumed

    @property
    def output(self) -> str:
        return self.raw.decode("utf-8", "replace")

    def _pump(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # the child closed the terminal (exited)
            return False
        self.raw += data
        return bool(data)

    def expect(self, text: str, timeout: float = 60.0) -> str:
        """Wait until `text` appears after what was read before; what came up to its end."""
        deadline = time.monotonic() + timeout
        token = text.encode()
        while (at := self.raw.find(token, self.read_to)) < 0:
            if time.monotonic() > deadline or not self._pump(0.1):
                raise AssertionError(f"no {text!r} within {timeout} s; the terminal shows:\n{self.output[-2000:]}")
        start, self.read_to = self.read_to, at + len(token)
        return self.raw[start:self.read_to].decode("utf-8", "replace")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code, reading what it prints meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._pump(0.05):
                    if not select.select([self.fd], [], [], 0)[0]:
                        break
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            self._pump(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {timeout} s:\n{self.output[-2000:]}")


class RecordingProxy:
    """Every request forwarded to `upstream`; the JSON bodies of `POST /api/chat` kept in `chats`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.chats: list[dict] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "RecordingProxy":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward(b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path == "/api/chat":
                    proxy.chats.append(json.loads(body))
                self._forward(body)

            def _forward(self, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                with httpx.Client(timeout=None) as client, client.stream(
                        self.command, proxy.upstream + self.path, content=body or None, headers=headers) as answer:
                    self.send_response(answer.status_code)
                    self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in answer.iter_raw():
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")

        return Handler


def run_cli(serving: Serving, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m supervisor ARGV --runtime-dir` of the running `serving`, to completion."""
    return subprocess.run([sys.executable, "-m", "supervisor", *argv, "--runtime-dir", str(serving.runtime_dir)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout)
