"""What the Linux probe tests share (no tests here): the captured /proc and cgroup roots
(described in tests/fixtures/probe/README.md), the tests' own plain `split()` readers of
them (independent of the probe's parser), a copy of a root to break, and a fresh set of
once-only warnings for each test.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from shared import probe as facade

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux probes")

FIXTURES = Path(__file__).parent / "fixtures" / "probe"
V1_HOST = FIXTURES / "linux_v1_host"
V1_LIMITED = FIXTURES / "linux_v1_limited"
V2_CONTAINER = FIXTURES / "linux_v2_container"
V2_SYSTEMD = FIXTURES / "linux_v2_systemd"
GiB = 1024**3


def kb_fields(path: Path) -> dict[str, int]:
    """`Key: N kB` lines -> bytes (the test's own, independent reader)."""
    out = {}
    for line in path.read_text().splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0]] = int(parts[1]) * 1024
    return out


def kv_fields(path: Path) -> dict[str, int]:
    """`key N` lines (memory.stat) -> ints."""
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def one_int(path: Path) -> int:
    return int(path.read_text())


def copy_root(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees its own first warning (the set is process-wide)."""
    facade._warned.clear()
    yield
    facade._warned.clear()
