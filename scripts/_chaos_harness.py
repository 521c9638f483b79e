"""What every chaos scenario shares: the run's Context (its sizes, throwaway models and private
cache), a supervisor in a subprocess, its clients, and how a result is counted (scripts/chaos.py
runs the scenarios; scripts/_chaos_processes.py, _chaos_fuzz.py, _chaos_hostile.py,
chaos_trust.py and chaos_swap.py hold them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor.wiring.bus import Endpoints, NotRunning  # noqa: E402
from tests.process_harness import sigterm_then_kill  # noqa: E402

MiB = 1024 * 1024
WEDGE_LINE = re.compile(r"Worker \S+ \(pid (\d+)\): .*: wedged; killing it")


@dataclass
class Row:
    scenario: str
    requests: int = 0
    finished: int = 0
    clear: int = 0       # a 4xx, or a 503/SSE error that says what happened
    hung: int = 0        # no answer within the client's deadline (or a dropped connection)
    e5xx: int = 0        # a 500 (or a crash, for the config scenario)
    orphans: int = 0
    false_kills: int = 0
    foreign: int = 0     # a foreign origin or Host changed the guard / what is loaded, or read state
    touched: int = 0     # files outside the prompt cache's tier changed, removed or followed (H5.3)
    cross_key: int = 0   # one key's cached-token counts told it about another key's prompts
    leaks: str = "-"
    note: str = ""


# ---------------------------------------------------------------------------
# a supervisor in a subprocess


class Serve:
    """`python -m supervisor serve` with a TOML config, its log in a file."""

    def __init__(self, workdir: Path, config: str, runtime_dir: Path, env: dict[str, str] | None = None,
                 nofile: int = 0) -> None:
        self.nofile = nofile  # RLIMIT_NOFILE of the supervisor (0: inherited)
        self.config_path = workdir / f"chaos-{time.monotonic_ns()}.toml"
        self.config_path.write_text(config)
        self.runtime_dir = runtime_dir
        self.log_path = workdir / f"{self.config_path.stem}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 60.0) -> "Serve":
        cmd = [sys.executable, "-m", "supervisor", "serve", "--config", str(self.config_path),
               "--runtime-dir", str(self.runtime_dir), "--http", "127.0.0.1:0"]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=self._limits if self.nofile else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                endpoints = Endpoints.load(self.runtime_dir)
                port = int(endpoints.http.rsplit(":", 1)[1]) if endpoints.http else 0
                if endpoints.pid == self.proc.pid and port:  # 0 until the front door has bound
                    self.port = port
                    return self
            except (NotRunning, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError("serve did not start")

    def _limits(self) -> None:
        import resource

        # the soft limit only: mlx_lm raises its own to 2048 in each worker, the supervisor keeps this one
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not healthy after {timeout:.0f} s: {self.log_path.read_text()[-2000:]}")

    def worker_pids(self) -> dict[str, int]:
        return {m["id"]: m["pid"] for m in self.get("/status").json()["models"] if m.get("pid")}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            sigterm_then_kill(self.proc)
        self.log.close()


def base_config(models: dict[str, Path], pinned: bool = True, **supervisor) -> str:
    sup = {"heartbeat_interval": 0.25, "heartbeat_timeout": 2.0, "restart_max": 1000, "restart_period": 1.0,
           "stop_grace": 3.0, "allow_drills": True, "failed_retry_first": 1.0, **supervisor}
    lines = ["[supervisor]"] + [f"{k} = {json.dumps(v)}" for k, v in sup.items()]
    for model_id, path in models.items():
        lines += ["[[models]]", f'id = "{model_id}"', f'path = "{path}"', f"pinned = {str(pinned).lower()}"]
    return "\n".join(lines) + "\n"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def child_states(pid: int) -> list[tuple[int, str]]:
    """(pid, /proc state letter) of every child of `pid`, read from /proc (no signal sent)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append((int(entry), fields[0]))
    return found


def proc_counts(pid: int) -> dict[str, int]:
    """fds, threads, RSS (KiB) and zombie children of `pid` (Linux /proc)."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    zombies = sum(1 for _, state in child_states(pid) if state == "Z")
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task")),
            "rss_kib": rss, "zombies": zombies}


def false_kills(log_text: str, stopped: set[int]) -> int:
    """Wedge kills of workers nobody SIGSTOPped."""
    return sum(1 for m in WEDGE_LINE.finditer(log_text) if int(m[1]) not in stopped)


# ---------------------------------------------------------------------------
# clients


async def one_stream(client: httpx.AsyncClient, model: str, row: Row, deadline: float,
                     prompt: str = "tell me a story", max_tokens: int = 24) -> None:
    """One streamed chat request, classified."""
    row.requests += 1
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}

    async def read() -> tuple[int, str]:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            return response.status_code, "".join([chunk async for chunk in response.aiter_text()])

    try:
        status, text = await asyncio.wait_for(read(), deadline)
    except (asyncio.TimeoutError, httpx.HTTPError) as exc:
        row.hung += 1  # no answer in time, or a dropped connection: no clear answer either way
        print(f"   hung: {model}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    if status >= 500 and status != 503:
        row.e5xx += 1
    elif status != 200:
        row.clear += 1
    elif '"error"' in text:
        row.clear += 1
    elif text.rstrip().endswith("data: [DONE]"):
        row.finished += 1
    else:
        row.hung += 1
        print(f"   hung: {model}: a stream that ended without [DONE]: {text[-200:]!r}", file=sys.stderr)


async def clients(serve: Serve, models: list[str], row: Row, seconds: float, n: int = 8,
                  deadline: float = 60.0, **kw) -> None:
    end = time.monotonic() + seconds

    async def loop(i: int) -> None:
        async with httpx.AsyncClient(base_url=serve.url, timeout=deadline + 5) as client:
            while time.monotonic() < end:
                await one_stream(client, models[i % len(models)], row, deadline, **kw)

    await asyncio.gather(*(loop(i) for i in range(n)))


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (its workers), from /proc: works while it is frozen."""
    return [child for child, state in child_states(pid) if state != "Z"]


def rss_kib(pid: int) -> int:
    try:
        return proc_counts(pid)["rss_kib"]
    except OSError:
        return 0


def terminate(serve: Serve, row: Row, grace: float = 15.0) -> str:
    """SIGTERM, bounded: a supervisor that ignores it is hung (+1), then SIGKILLed;
    workers alive 5 s after it are orphans (killed too). Says what happened."""
    assert serve.proc is not None
    workers = children(serve.proc.pid)
    started = time.monotonic()
    said = ""
    if serve.proc.poll() is None:
        serve.proc.send_signal(signal.SIGTERM)
        try:
            serve.proc.wait(grace)
            said = f"SIGTERM: exit in {time.monotonic() - started:.1f} s"
        except subprocess.TimeoutExpired:
            row.hung += 1
            serve.proc.send_signal(signal.SIGTERM)  # a second one, as a user would
            try:
                serve.proc.wait(5)
                said = f"SIGTERM ignored for {grace:.0f} s, the second one worked"
            except subprocess.TimeoutExpired:
                serve.proc.kill()
                serve.proc.wait(10)
                said = f"SIGTERM ignored twice ({grace + 5:.0f} s): SIGKILLed"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.05)
    left = [pid for pid in workers if alive(pid)]
    row.orphans += len(left)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    serve.log.close()
    return said


def classify(row: Row, status: int) -> None:
    row.requests += 1
    if 200 <= status < 300:
        row.finished += 1
    elif status >= 500 and status != 503:
        row.e5xx += 1
    else:
        row.clear += 1


# ---------------------------------------------------------------------------
# the run


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
