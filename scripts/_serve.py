"""Shared by the benchmarks that run `python -m supervisor serve` as a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    """`python -m supervisor serve` as a child process, on a config the benchmark writes.

    The front door binds a free port (`--http 127.0.0.1:0`); `base` is its URL
    once `/health` answers. The supervisor's log goes to `log`.
    """

    def __init__(self, config_text: str, *, config: Path, runtime: Path, log: Path, timeout: float,
                 env: dict[str, str] | None = None, stop_grace: float = 30.0, root: Path = ROOT) -> None:
        """`root`: the checkout whose code serves (another one's for an A/B run: `python -m` takes its
        working directory's packages first, and the workers it spawns inherit that path)."""
        config.write_text(config_text)
        self.runtime, self.log, self.stop_grace = runtime, log, stop_grace
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "serve", "--config", str(config), "--runtime-dir",
             str(runtime), "--http", "127.0.0.1:0"],
            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # noqa: SIM115
        self.base = wait_ready(self.proc, runtime, log, timeout)

    def worker_pid(self, model_id: str) -> int:
        """The pid of the worker serving `model_id` (from /status), not a spare's."""
        import httpx

        models = httpx.get(f"{self.base}/status", timeout=30).json()["models"]
        pid = next((m.get("pid") for m in models if m["id"] == model_id), None)
        if not pid:
            raise SystemExit(f"/status names no worker for {model_id!r}; see {self.log}")
        return int(pid)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(self.stop_grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve_private(config_text: str, work: Path, *, root: Path | None = None, timeout: float = 300) -> ServeProcess:
    """A server on `config_text` whose runtime dir, log and `MEMVISOR_CACHE` are its own, under
    `work`: no prompt cache on disk from another run feeds it. `root`: the checkout that serves
    (PYTHONPATH and working folder; this one by default)."""
    global ROOT
    work.mkdir(parents=True, exist_ok=True)
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, MEMVISOR_CACHE=str(work / "cache"))
    saved = ROOT
    if root is not None:
        env["PYTHONPATH"] = str(root)
        ROOT = root
    try:
        return ServeProcess(config_text, config=work / "config.toml", runtime=runtime, log=work / "serve.log",
                            timeout=timeout, env=env)
    finally:
        ROOT = saved


def wait_ready(proc: subprocess.Popen, runtime: Path, log: Path, timeout: float) -> str:
    """The front door's base URL once `/health` answers 200 (the bound port is in
    endpoints.json); SystemExit naming the log when the supervisor exits or stalls."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the supervisor exited ({proc.returncode}); see {log}")
        try:
            http = json.loads((runtime / "endpoints.json").read_text()).get("http", "")
            if http and not http.endswith(":0") and httpx.get(f"http://{http}/health").status_code == 200:
                return f"http://{http}"
        except (OSError, ValueError, httpx.HTTPError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"the supervisor did not become healthy in {timeout:.0f} s; see {log}")


def proc_status(key: str) -> int | None:
    """A `kB` line of Linux's /proc/self/status in bytes (VmRSS, VmHWM, RssAnon ...); None elsewhere."""
    import re

    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def cache_root() -> Path:
    """Where the benchmarks keep the models they generate, between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memvisor" / "bench"


def bench_model(name: str, size: int, seed: int, dtype: str, bits: int = 0) -> Path:
    """A generated model at cache_root()/NAME (made once, with a line saying so), quantized to
    `bits` when not 0."""
    from modelfiles.modelgen import make_model
    from shared.sizes import format_size

    path = cache_root() / name
    if not (path / "config.json").exists():
        quantized = f", quantized to {bits} bits," if bits else ""
        print(f"generating a {format_size(size)} {dtype} model{quantized} in {path} (once)...", flush=True)
        make_model(path, size, seed=seed, force=True, dtype=dtype, bits=bits)
    return path


def add_model_args(parser, *, size: str, streams: str, tokens: int = 64) -> None:
    """The engine benchmarks' shared flags: which model, how many streams, tokens per stream."""
    parser.add_argument("--model", type=Path, help="a local MLX model folder (default: a generated one)")
    parser.add_argument("--size", default=size, help=f"weights of the generated model (default {size})")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--streams", default=streams, help=f"comma-separated stream counts (default {streams})")
    parser.add_argument("--tokens", type=int, default=tokens, help=f"max tokens per stream (default {tokens})")


def model_from_args(args, prefix: str) -> Path:
    """`--model`, else the generated model of `--size` and `--dtype` (made once, seed 11)."""
    from shared.sizes import parse_size

    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"--model: no config.json in {args.model}")
        return Path(args.model)
    size = parse_size(args.size)
    return bench_model(f"{prefix}-{size}-{args.dtype}", size, 11, args.dtype)
