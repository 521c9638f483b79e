"""Shared by the benchmarks that run `python -m supervisor serve` as a child process."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


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
