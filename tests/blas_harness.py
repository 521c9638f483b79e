"""What the BLAS tests share: the Linux-only mark and a process's mapped files (no tests here)."""

from __future__ import annotations

import pytest

from shared.probe import blas_plan as found

linux_only = pytest.mark.skipif(not found.applies(), reason="MLX on macOS uses Accelerate; nothing to load")


def mapped_paths(pid: int | str) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if len(line.split()) >= 6}
