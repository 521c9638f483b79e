"""A fake pynvml module, for the NVML probe and device status tests (no tests here)."""

from __future__ import annotations

import types
from types import SimpleNamespace

GiB = 1024**3


H200_TOTAL = 143_771 * 1024 * 1024   # what nvidia-smi shows for an H200 (143771 MiB)


class NVMLError(Exception):
    """Shaped like pynvml.NVMLError: an exception carrying the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def proc(pid, used):
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)


def fake_pynvml(
    *, count=1, compute=(), graphics=(), init_error=None, name="NVIDIA H200",
    memory=(H200_TOTAL, H200_TOTAL - 10 * GiB, 10 * GiB), fail=None,
):
    """A module with the calls `read_device` makes; `calls` counts each one."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    mod.calls = {}
    total, free, used = memory

    def call(fn_name, result):
        def fn(*args):
            mod.calls[fn_name] = mod.calls.get(fn_name, 0) + 1
            if fail is not None and fn_name in fail:
                raise fail[fn_name]
            return result(*args) if callable(result) else result
        return fn

    def init():
        if init_error is not None:
            raise init_error

    mod.nvmlInit = call("nvmlInit", init)
    mod.nvmlDeviceGetCount = call("nvmlDeviceGetCount", count)
    mod.nvmlDeviceGetHandleByIndex = call("nvmlDeviceGetHandleByIndex", lambda i: ("handle", i))
    mod.nvmlDeviceGetHandleByUUID = call("nvmlDeviceGetHandleByUUID", lambda u: ("handle", u))
    mod.nvmlDeviceGetIndex = call("nvmlDeviceGetIndex", 3)
    mod.nvmlDeviceGetName = call("nvmlDeviceGetName", name)
    mod.nvmlDeviceGetUUID = call("nvmlDeviceGetUUID", "GPU-0000")
    mod.nvmlDeviceGetMemoryInfo = call(
        "nvmlDeviceGetMemoryInfo", SimpleNamespace(total=total, free=free, used=used))
    mod.nvmlDeviceGetComputeRunningProcesses = call("nvmlDeviceGetComputeRunningProcesses", list(compute))
    mod.nvmlDeviceGetGraphicsRunningProcesses = call("nvmlDeviceGetGraphicsRunningProcesses", list(graphics))
    return mod
