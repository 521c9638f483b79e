"""NVIDIA device memory through NVML (SPEC D1 readings).

On a discrete GPU device memory is a pool of its own (SPEC D). The supervisor
never imports MLX, so it reads the device itself through NVML (`pynvml`, from
the `nvidia-ml-py` package of the `cuda` extra): total, free and used bytes,
and the device bytes each process holds. Where NVML cannot be had, a CUDA
worker's `mx.device_info()` (sent in its hello) still gives total and free,
through `reading_from_device_info`.

The promises of `shared.probe` hold here too:

* Nothing raises into the caller. `read_device` answers None when `pynvml` is
  not installed, `nvmlInit` fails (no driver, a driver/library mismatch), the
  device does not exist, or an NVML call fails; the cause is logged once
  (`warn_once`), not once per tick.
* The import is light: `pynvml` is imported on the first reading, never at
  import time, and only this module touches it.

NVML is initialised once per process (again after a fork: NVML state does not
survive one) and device handles are kept. A missing `pynvml` or a failed
`nvmlInit` is remembered for the life of the process, so a machine without a
driver pays for the attempt once; a failed call on a device drops its handle
and the next reading tries again.

Per-process bytes, and their limits
-----------------------------------
`per_process` maps pid -> device bytes from `nvmlDeviceGetComputeRunningProcesses`
and `nvmlDeviceGetGraphicsRunningProcesses`. A process that holds both a
compute and a graphics context is listed in both with the same figure, so a
pid's bytes are the largest figure listed for it, never a sum. NVML gives no
figure (`usedGpuMemory` None, or the raw NVML_VALUE_NOT_AVAILABLE) inside many
containers and under MIG: such a pid is left out of `per_process` and named
in `unknown_pids`, since an unknown figure is not 0.

The pids are the ones the driver reports. In a container with its own pid
namespace they are often HOST pids, which match none of ours (or, by bad luck,
an unrelated one of ours), and some drivers list nothing at all. So a lookup
(`device_bytes_for`) answers None when it finds no figure, and the caller
falls back as SPEC D1 says: the worker's MLX active + pool bytes, as it
reports them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from shared.probe.base import gpu_kind, warn_once

DeviceSource = Literal["nvml", "device_info"]

# What the NVML C API puts in usedGpuMemory when it has no figure; pynvml turns
# it into None, older releases passed it through.
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1


class DeviceReading(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One device's memory, in bytes (SPEC D1).

    `free`/`used` are None only in a reading built from a hello that gave no
    free figure: then the device's dynamic ceiling falls back to its static
    one, as SPEC C2 does for host counters. `per_process` holds only figures
    NVML gave (see the module text for containers and MIG); `unknown_pids`
    are the processes it listed without one. A reading from `mx.device_info()`
    has no per-process figures at all.
    """

    index: int
    name: str
    total: int
    free: int | None
    used: int | None
    per_process: dict[int, int] = {}
    unknown_pids: list[int] = []
    uuid: str | None = None
    source: DeviceSource = "nvml"
    warnings: list[str] = []


# ---------------------------------------------------------------------------
# The NVML session: one per process.


class _Session:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.nvml: Any = None
        self.failed: str | None = None          # sticky: pynvml absent or nvmlInit failed
        self.handles: dict[int | str, Any] = {}


_session: _Session | None = None
_lock = threading.Lock()
_why = ""  # why the last read_device answered None ("" after a reading)


def unavailable_reason() -> str:
    """Why the last `read_device` in this process answered None, in words
    ("" when it gave a reading): `probe` shows it beside "no NVIDIA device"."""
    return _why


def _reset() -> None:
    """Forget the session (tests; a later reading imports and initialises again)."""
    global _session, _why
    with _lock:
        _session = None
        _why = ""


def _open() -> _Session | None:
    """This process's initialised session, or None when NVML cannot be had."""
    global _session
    with _lock:
        session = _session
        if session is None or session.pid != os.getpid():
            session = _session = _Session()
            try:
                import pynvml
            except Exception as exc:  # noqa: BLE001 - an optional extra, absent or broken
                session.failed = warn_once(
                    "nvml:absent",
                    f"NVML unavailable (pynvml not importable: {exc}); install the 'cuda' extra "
                    "(nvidia-ml-py) for device readings",
                )
                return None
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # noqa: BLE001 - no driver, mismatch, no permission
                session.failed = warn_once(
                    f"nvml:init:{type(exc).__name__}:{exc}",
                    f"NVML unavailable (nvmlInit failed: {exc}); no device readings from NVML",
                )
                return None
            session.nvml = pynvml
        return None if session.failed is not None else session


def _handle(session: _Session, index: int, uuid: str | None) -> Any:
    """The kept device handle; raises what NVML raises."""
    key: int | str = uuid if uuid is not None else index
    with _lock:
        handle = session.handles.get(key)
        if handle is None:
            if uuid is not None:
                handle = session.nvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                handle = session.nvml.nvmlDeviceGetHandleByIndex(index)
            session.handles[key] = handle
        return handle


def _text(value: Any) -> str:
    if isinstance(value, bytes):  # pynvml before 11.5 returned bytes
        return value.decode("utf-8", "replace")
    return str(value)


def _processes(nvml: Any, handle: Any) -> tuple[dict[int, int], list[int], list[str]]:
    """pid -> bytes, pids without a figure, and warnings, from both process lists."""
    per_process: dict[int, int] = {}
    unknown: set[int] = set()
    warnings: list[str] = []
    calls = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")
    for call in calls:
        function = getattr(nvml, call, None)
        if function is None:
            continue
        try:
            for entry in function(handle) or ():
                pid = getattr(entry, "pid", None)
                used = getattr(entry, "usedGpuMemory", None)
                if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                    continue
                if not isinstance(used, int) or isinstance(used, bool) or not 0 <= used < NVML_VALUE_NOT_AVAILABLE:
                    unknown.add(pid)
                    continue
                per_process[pid] = max(used, per_process.get(pid, 0))
        except Exception as exc:  # noqa: BLE001 - NotSupported on some GPUs and vGPUs
            warnings.append(warn_once(
                f"nvml:{call}:{type(exc).__name__}",
                f"NVML {call} failed ({exc}); per-process device bytes incomplete",
            ))
    return per_process, sorted(unknown.difference(per_process)), warnings


def read_device(index: int = 0, *, uuid: str | None = None) -> DeviceReading | None:
    """SPEC D1: device `index` (NVML's numbering) or the device with `uuid`.

    NVML numbers devices its own way and ignores CUDA_VISIBLE_DEVICES, so a
    worker's device 0 need not be NVML's 0: the `uuid` from the worker's
    `mx.device_info()` names the device unambiguously. None when there is no
    reading (the cause is logged once; `unavailable_reason` gives it every time).
    """
    global _why
    session = _open()
    if session is None:
        _why = (_session.failed if _session is not None else None) or "NVML unavailable"
        return None
    nvml = session.nvml
    what = f"uuid {uuid}" if uuid is not None else f"index {index}"
    try:
        if uuid is None:
            count = int(nvml.nvmlDeviceGetCount())
            if count <= 0:
                _why = warn_once("nvml:no-device", "NVML sees no NVIDIA device; no device readings")
                return None
            if not 0 <= index < count:
                _why = warn_once(f"nvml:no-device:{index}",
                                 f"NVML has no device {index} (it sees {count}); no device reading")
                return None
        handle = _handle(session, index, uuid)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        total, free, used = int(memory.total), int(memory.free), int(memory.used)
        name = _text(nvml.nvmlDeviceGetName(handle))
        if uuid is not None:
            index = int(nvml.nvmlDeviceGetIndex(handle))
            found_uuid: str | None = uuid
        else:
            found_uuid = _optional_uuid(nvml, handle)
    except Exception as exc:  # noqa: BLE001 - GPU lost, NotFound, a driver hiccup
        with _lock:
            session.handles.clear()
        _why = warn_once(f"nvml:read:{what}:{type(exc).__name__}",
                         f"NVML reading of device {what} failed ({exc!r}); no device reading")
        return None
    _why = ""
    per_process, unknown, warnings = _processes(nvml, handle)
    return DeviceReading(
        index=index, name=name, total=total, free=free, used=used,
        per_process=per_process, unknown_pids=unknown, uuid=found_uuid,
        source="nvml", warnings=warnings,
    )


def _optional_uuid(nvml: Any, handle: Any) -> str | None:
    try:
        return _text(nvml.nvmlDeviceGetUUID(handle))
    except Exception:  # noqa: BLE001 - nice to have, not needed for the figures
        return None


def device_bytes_for(reading: DeviceReading | None, pids: int | Iterable[int]) -> int | None:
    """The device bytes NVML gives for `pids` (a worker's pid, or it and its
    children); None when it gives none of them.

    None means "unknown", never 0: the pid is not on the device, its figure
    is not available (containers, MIG), or NVML reports host pids that are not
    ours. The caller then takes the worker's MLX active + pool bytes (SPEC D1).
    """
    if reading is None:
        return None
    wanted = [pids] if isinstance(pids, int) else list(pids)
    found = [reading.per_process[pid] for pid in set(wanted) if pid in reading.per_process]
    if not found:
        return None
    return sum(found)


# ---------------------------------------------------------------------------
# The fallback: a CUDA worker's `mx.device_info()`.


def reading_from_device_info(info: dict[str, Any], index: int = 0) -> DeviceReading | None:
    """A device reading from a worker's hello, for when NVML gives none.

    Only a CUDA `mx.device_info()` qualifies (`gpu_kind`): Metal memory is
    unified with the host's and CPU has no device, so both give None. MLX
    takes `free_memory` from NVML when it can (else `cudaMemGetInfo`), at the
    moment the worker called it: a hello's figure ages, and per-process bytes
    are not in it. Bad values give None and one warning.
    """
    if gpu_kind(info) != "cuda":
        return None
    try:
        total = _byte_count(info, "total_memory")
        free = _byte_count(info, "free_memory") if "free_memory" in info else None
    except ValueError as exc:
        warn_once(f"device-info:{exc}", f"device reading from the worker's hello unusable: {exc}")
        return None
    if free is not None and free > total:
        warn_once(f"device-info:free>{total}",
                  f"device_info free_memory {free} exceeds total_memory {total}; free unknown")
        free = None
    uuid = info.get("uuid")
    return DeviceReading(
        index=index,
        name=str(info.get("device_name", "")),
        total=total,
        free=free,
        used=None if free is None else total - free,
        uuid=uuid if isinstance(uuid, str) else None,
        source="device_info",
    )


def _byte_count(info: dict[str, Any], key: str) -> int:
    value = info.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"device_info[{key!r}] is not a byte count: {value!r}")
    return value
