"""What the guard sees: host memory counters, process footprints, GPU caps.

This is the platform-neutral door (SPEC C inputs, U1 footprints). The work is
done by `shared.probe.linux` or `shared.probe.macos`, chosen once, on
first use; any other platform gets a backend that only knows the physical
total, so SPEC C2's last fallback (dynamic = static) applies.

Two promises hold on every platform:

* A reading never raises into the caller. A file that is missing, garbled or
  truncated, or a call that fails, degrades the reading the way SPEC C2 says
  (full counters -> only `available` -> nothing) and logs ONE warning per
  cause, not one per tick: the enforcer polls every second and a log flood
  would bury the one line that matters.
* The import stays light (msgspec and the standard library only): worker
  processes import this module to measure their own footprint, and a worker
  must never pay for, or be broken by, the supervisor's heavier machinery.

The types and the helpers the backends share live in `shared.probe.base`
(re-exported here), so no backend imports this module back.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from shared.host import HostCounters
from shared.probe.base import (
    GpuKind,
    HostReading,
    ProbeError,
    Psi,
    PsiLine,
    TotalSource,
    _warned,  # noqa: F401 - one warning per cause; tests clear it as `probe._warned`
    choose_total,
    gpu_kind,
    warn_once,
)
from shared.sizes import MiB

__all__ = [
    "GpuKind",
    "HostReading",
    "ProbeError",
    "Psi",
    "PsiLine",
    "TotalSource",
    "choose_total",
    "exact_footprint",
    "footprint",
    "gpu_cap_from_device_info",
    "gpu_kind",
    "gpu_share_of_usage",
    "host_gpu_cap",
    "own_footprint",
    "read_host",
    "read_host_counters",
    "read_wired",
    "warn_once",
]

# ---------------------------------------------------------------------------
# GPU caps (SPEC C: gpu_cap_raw; C4). The supervisor never imports MLX: each
# worker sends `mx.device_info()` in its hello and these turn it into numbers.


def _info_int(info: dict[str, Any], key: str) -> int:
    value = info.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"device_info[{key!r}] is not a byte count: {value!r}")
    number = int(value)
    if number < 0:
        raise ValueError(f"device_info[{key!r}] is negative: {number}")
    return number


def gpu_cap_from_device_info(info: dict[str, Any]) -> int:
    """SPEC gpu_cap_raw from a worker's `mx.device_info()`; 0 = not a candidate.

    Metal: the kernel's `iogpu.wired_limit_mb` when the user set it (> 0),
    else Apple's `max_recommended_working_set_size` -- the size above which
    Metal refuses to wire, which is what panicked machines in the seed when a
    plan ignored it. CUDA: the device's total memory (its own pool, reported,
    not folded into the unified-memory formulas). CPU: 0. Bad values give 0
    and one warning rather than an exception inside the enforcer.
    """
    kind = gpu_kind(info)
    try:
        if kind == "metal":
            wired_mb = _wired_limit_mb()
            if wired_mb > 0:
                return wired_mb * MiB
            return _info_int(info, "max_recommended_working_set_size")
        if kind == "cuda":
            return _info_int(info, "total_memory")
    except ValueError as exc:
        warn_once(f"gpu-cap:{exc}", f"GPU cap unknown, treated as none: {exc}")
    return 0


def host_gpu_cap(info: dict[str, Any]) -> tuple[int, int]:
    """(gpu_cap_raw for the host formulas, device memory reported beside them).

    SPEC C folds an accelerator cap into the host ceiling only for unified
    memory (Metal). A CUDA device keeps its memory in a pool of its own (SPEC
    D, a later rule set): folding it in made a 24 GiB GPU on a 256 GiB host a
    24 GiB host ceiling. Its size is reported, and binds nothing here.
    """
    cap = gpu_cap_from_device_info(info)
    if gpu_kind(info) == "cuda":
        return 0, cap
    return cap, 0


def gpu_share_of_usage(info: dict[str, Any], mlx_active: int, mlx_cache: int) -> int:
    """SPEC C `own_gpu` for one worker: the part of its footprint the GPU holds.

    On Metal every MLX buffer (active plus the allocator's cache) is a Metal
    allocation counted in the process footprint, so that sum is the GPU share.
    On CUDA device memory is a separate pool that SPEC keeps out of the
    unified formulas, and on CPU nothing is GPU-held: both give 0.
    """
    if gpu_kind(info) != "metal":
        return 0
    return max(0, int(mlx_active)) + max(0, int(mlx_cache))


def _wired_limit_mb() -> int:
    if sys.platform != "darwin":
        return 0
    from shared.probe import macos as probe_macos

    return probe_macos.wired_limit_mb()


# ---------------------------------------------------------------------------
# The backend, chosen once per process.


class _PhysicalOnly:
    """For platforms without a probe: the RAM size and nothing else (C2)."""

    def __init__(self) -> None:
        self.physical = _sysconf_physical()

    def _counters(self, budget: int) -> tuple[HostCounters, TotalSource, str]:
        message = warn_once(
            f"platform:{sys.platform}",
            f"no memory probe for platform {sys.platform!r}: the dynamic ceiling "
            "falls back to the static one (SPEC C2)",
        )
        total, source = choose_total(self.physical, None, budget)
        return HostCounters(total=total), source, message

    def counters(self, budget: int = 0) -> HostCounters:
        return self._counters(budget)[0]

    def reading(self, budget: int = 0) -> HostReading:
        counters, source, message = self._counters(budget)
        return HostReading(
            platform=sys.platform, counters=counters, physical_total=self.physical,
            budget=max(0, budget), total_source=source,
            sources={"physical_total": "sysconf(SC_PHYS_PAGES) * sysconf(SC_PAGE_SIZE)"},
            warnings=[message],
        )

    def footprint(self, pid: int) -> int | None:
        return None

    def exact_footprint(self, pid: int) -> int | None:
        return None


def _sysconf_physical() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


_backend: Any = None
_backend_lock = threading.Lock()


def _get_backend() -> Any:
    global _backend
    if _backend is None:
        with _backend_lock:
            if _backend is None:
                _backend = _make_backend()
    return _backend


def _make_backend() -> Any:
    try:
        if sys.platform.startswith("linux"):
            from shared.probe.linux import LinuxProbe

            return LinuxProbe()
        if sys.platform == "darwin":
            from shared.probe.macos import MacProbe

            return MacProbe()
    except Exception as exc:  # noqa: BLE001 - never let a probe break the guard
        warn_once(f"backend:{exc}", f"memory probe unavailable ({exc}); physical total only")
    return _PhysicalOnly()


def _fallback_counters(budget: int, exc: BaseException) -> HostCounters:
    """The last line of defence: a backend bug still yields a usable reading."""
    warn_once(f"unexpected:{type(exc).__name__}", f"memory reading failed unexpectedly: {exc!r}")
    total, _ = choose_total(_sysconf_physical(), None, budget)
    return HostCounters(total=total)


def read_host_counters(budget: int = 0) -> HostCounters:
    """The per-tick fast path: SPEC C2's host counters, total already bound."""
    try:
        counters: HostCounters = _get_backend().counters(budget)
        return counters
    except Exception as exc:  # noqa: BLE001
        return _fallback_counters(budget, exc)


def read_host(budget: int = 0) -> HostReading:
    """The full reading for `probe`, status and `tiers`: counters plus detail."""
    try:
        reading: HostReading = _get_backend().reading(budget)
        return reading
    except Exception as exc:  # noqa: BLE001
        counters = _fallback_counters(budget, exc)
        return HostReading(
            platform=sys.platform, counters=counters, physical_total=_sysconf_physical(),
            budget=max(0, budget), total_source="physical",
            warnings=[f"memory reading failed unexpectedly: {exc!r}"],
        )


def footprint(pid: int) -> int | None:
    """SPEC U1 process footprint in bytes; None when the process is gone.

    macOS: `phys_footprint`. Linux: the process's private anonymous resident
    memory, an O(1) kernel counter (see `shared.probe.linux` for why not
    the smaps_rollup USS on the tick path; `exact_footprint` gives that).
    """
    try:
        found: int | None = _get_backend().footprint(int(pid))
        return found
    except Exception as exc:  # noqa: BLE001
        warn_once(f"footprint:{type(exc).__name__}", f"footprint reading failed: {exc!r}")
        return None


def exact_footprint(pid: int) -> int | None:
    """The slow, exact private footprint (Linux USS from smaps_rollup).

    Costs about 10 ms per GiB resident on Linux (measured), so it is for
    `probe` and occasional checks, never for every tick. On macOS it equals
    `footprint`.
    """
    try:
        exact: int | None = _get_backend().exact_footprint(int(pid))
        return exact
    except Exception as exc:  # noqa: BLE001
        warn_once(f"uss:{type(exc).__name__}", f"exact footprint reading failed: {exc!r}")
        return None


def read_wired() -> int | None:
    """SPEC M3: the OS's wired memory in bytes, read after every worker exit; None where there is no
    such count to watch (only macOS strands wired memory) or it cannot be read. One
    host_statistics64 call: no subprocess, nothing that waits."""
    if sys.platform != "darwin":
        return None
    try:
        from shared.probe.macos import MacProbe

        backend = _get_backend()
        return backend.wired_bytes() if isinstance(backend, MacProbe) else None
    except Exception as exc:  # noqa: BLE001 - never let a probe break the guard
        warn_once(f"wired:{type(exc).__name__}", f"wired memory reading failed: {exc!r}")
        return None


def own_footprint() -> int | None:
    """This process's footprint (the supervisor's share of U2, or a worker's U1)."""
    return footprint(os.getpid())
