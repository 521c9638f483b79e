"""The probe's types and the helpers every backend shares (no backend imported here).

`shared.probe` (the door) chooses a backend lazily; the backends (`linux`,
`macos`, `procfs`, `cgroups`, `nvml`) take what they have in common from
here, so nothing inside the package imports the package back: the arrows run
one way, door -> backend -> base.

Public names (re-exported by `shared.probe`): TotalSource, GpuKind,
ProbeError, PsiLine, Psi, HostReading, warn_once, choose_total, gpu_kind.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

import msgspec

from shared.host import HostCounters

log = logging.getLogger("memvisor.probe")

TotalSource = Literal["physical", "container", "budget"]
GpuKind = Literal["metal", "cuda", "cpu"]


class ProbeError(Exception):
    """A reading that could not be taken; the message names the file or call."""


class PsiLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One line of a pressure-stall file: % of time stalled, and total µs."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


class Psi(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Memory pressure stall information (Linux PSI)."""

    some: PsiLine
    full: PsiLine | None = None   # absent on kernels that only report `some`
    source: str = ""


class HostReading(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `probe` shows; `counters` is what the policy consumes.

    `sources` maps each number to the file (and field) or call it came from,
    so a wrong ceiling can be traced to the reading behind it. `detail` holds
    platform figures that are shown but not used by the formulas (wired,
    speculative, anon, shmem ...), in bytes unless the key says otherwise.
    """

    platform: str
    counters: HostCounters
    physical_total: int
    container_limit: int | None = None
    container_usage: int | None = None
    cgroup: str | None = None          # "v1 <dir>" / "v2 <dir>": the memory cgroup whose
                                       # limit binds, else the process's own
    budget: int = 0
    total_source: TotalSource = "physical"
    swap_total: int | None = None
    zram: bool | None = None           # a zram device is active as swap
    zswap: bool | None = None          # the zswap front-end is enabled
    psi: Psi | None = None
    detail: dict[str, int] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []


# ---------------------------------------------------------------------------
# One warning per cause.

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(cause: str, message: str) -> str:
    """Log `message` the first time `cause` is seen; return it either way.

    The returned text goes into the reading's `warnings`, so `probe` and
    status can show a degraded reading every time without the log repeating.
    """
    with _warned_lock:
        first = cause not in _warned
        _warned.add(cause)
    if first:
        log.warning("%s", message)
    return message


def choose_total(
    physical: int, container: int | None, budget: int
) -> tuple[int, TotalSource]:
    """SPEC C inputs: total = min(physical, container limit, budget).

    Ties go to the first of physical, container, budget, so a budget equal to
    the RAM does not claim to bind. A container limit or budget of 0 or less
    is not a candidate (0 means "none", never "no memory").
    """
    total: int = physical
    source: TotalSource = "physical"
    if container is not None and 0 < container < total:
        total, source = container, "container"
    if budget > 0 and budget < total:
        total, source = budget, "budget"
    return total, source


def gpu_kind(info: dict[str, Any]) -> GpuKind:
    """Which accelerator a worker's `mx.device_info()` describes.

    Metal reports `max_recommended_working_set_size`; the CUDA backend reports
    `total_memory` (mlx/backend/cuda/device_info.cpp); the CPU backend only
    names the architecture and device.
    """
    if not isinstance(info, dict):
        return "cpu"
    if "max_recommended_working_set_size" in info:
        return "metal"
    if "total_memory" in info:
        return "cuda"
    return "cpu"
