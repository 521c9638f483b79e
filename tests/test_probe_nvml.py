"""SPEC D1 readings through NVML (`shared.probe.nvml`), with a fake `pynvml`.

No GPU here: a stand-in module shaped like nvidia-ml-py's goes into
sys.modules. The real run is on an H200 (docs: device-cuda.md).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import msgspec
import pytest

from shared import probe
from shared.probe import nvml
from shared.probe.nvml import (
    NVML_VALUE_NOT_AVAILABLE,
    DeviceReading,
    device_bytes_for,
    read_device,
    reading_from_device_info,
)
from tests.nvml_harness import H200_TOTAL, GiB, NVMLError, fake_pynvml, proc


@pytest.fixture(autouse=True)
def fresh_state():
    nvml._reset()
    probe._warned.clear()
    yield
    nvml._reset()
    probe._warned.clear()


@pytest.fixture
def install(monkeypatch):
    def put(mod):
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod
    return put


def warnings_logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "memvisor.probe"]


# ---------------------------------------------------------------------------
# read_device


def test_d1_nvml_reads_total_free_used_and_each_process_bytes(install):
    install(fake_pynvml(compute=[proc(4101, 3 * GiB), proc(4102, 5 * GiB)]))
    reading = read_device()
    assert reading == DeviceReading(
        index=0, name="NVIDIA H200", total=H200_TOTAL, free=H200_TOTAL - 10 * GiB, used=10 * GiB,
        per_process={4101: 3 * GiB, 4102: 5 * GiB}, uuid="GPU-0000", source="nvml",
    )
    assert device_bytes_for(reading, 4101) == 3 * GiB
    assert device_bytes_for(reading, [4101, 4102]) == 8 * GiB


def test_d1_nvml_unavailable_process_bytes_are_unknown_not_zero(install):
    """Containers and MIG: usedGpuMemory None (or NVML's raw not-available) -> left out."""
    install(fake_pynvml(compute=[proc(4101, None), proc(4102, NVML_VALUE_NOT_AVAILABLE), proc(4103, GiB)]))
    reading = read_device()
    assert reading is not None
    assert reading.per_process == {4103: GiB}
    assert reading.unknown_pids == [4101, 4102]
    assert device_bytes_for(reading, 4101) is None
    assert device_bytes_for(reading, 4102) is None


def test_d1_nvml_process_in_compute_and_graphics_lists_is_counted_once(install):
    install(fake_pynvml(compute=[proc(4101, 2 * GiB)], graphics=[proc(4101, 2 * GiB), proc(4200, GiB)]))
    reading = read_device()
    assert reading is not None
    assert reading.per_process == {4101: 2 * GiB, 4200: GiB}


def test_d1_nvml_init_failure_gives_none_logs_once_and_is_not_retried(install, caplog):
    mod = install(fake_pynvml(init_error=NVMLError(9)))  # NVML_ERROR_DRIVER_NOT_LOADED
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert read_device() is None
        assert read_device() is None
    assert mod.calls["nvmlInit"] == 1
    logged = warnings_logged(caplog)
    assert len(logged) == 1 and "nvmlInit failed" in logged[0]


def test_d1_nvml_absent_gives_none_and_logs_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert read_device() is None
        assert read_device(1) is None
    logged = warnings_logged(caplog)
    assert len(logged) == 1 and "pynvml not importable" in logged[0]


def test_d1_nvml_no_device_gives_none(install, caplog):
    install(fake_pynvml(count=0))
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert read_device() is None
        assert read_device() is None
    assert len(warnings_logged(caplog)) == 1


def test_d1_nvml_index_past_the_last_device_gives_none(install):
    mod = install(fake_pynvml(count=1))
    assert read_device(1) is None
    assert "nvmlDeviceGetHandleByIndex" not in mod.calls


def test_d1_nvml_call_failure_gives_none_and_next_reading_takes_a_fresh_handle(install, monkeypatch):
    mod = install(fake_pynvml(fail={"nvmlDeviceGetMemoryInfo": NVMLError(15)}))  # GPU_IS_LOST
    assert read_device() is None
    good = fake_pynvml()
    monkeypatch.setattr(mod, "nvmlDeviceGetMemoryInfo", good.nvmlDeviceGetMemoryInfo)
    assert read_device() is not None
    assert mod.calls["nvmlDeviceGetHandleByIndex"] == 2
    assert mod.calls["nvmlInit"] == 1


def test_d1_nvml_process_list_failure_keeps_the_device_figures(install):
    install(fake_pynvml(fail={"nvmlDeviceGetComputeRunningProcesses": NVMLError(3)},  # NOT_SUPPORTED
                        graphics=[proc(4200, GiB)]))
    reading = read_device()
    assert reading is not None
    assert reading.total == H200_TOTAL and reading.used == 10 * GiB
    assert reading.per_process == {4200: GiB}
    assert any("nvmlDeviceGetComputeRunningProcesses" in w for w in reading.warnings)


def test_d1_nvml_initialises_once_and_keeps_the_handle(install):
    mod = install(fake_pynvml())
    for _ in range(3):
        assert read_device() is not None
    assert mod.calls["nvmlInit"] == 1
    assert mod.calls["nvmlDeviceGetHandleByIndex"] == 1
    assert mod.calls["nvmlDeviceGetMemoryInfo"] == 3


def test_d1_nvml_initialises_again_in_a_forked_child(install, monkeypatch):
    mod = install(fake_pynvml())
    assert read_device() is not None
    monkeypatch.setattr(nvml.os, "getpid", lambda: -1)
    assert read_device() is not None
    assert mod.calls["nvmlInit"] == 2


def test_d1_nvml_device_by_uuid_reports_nvml_index(install):
    """A worker's device 0 under CUDA_VISIBLE_DEVICES need not be NVML's 0: the uuid decides."""
    mod = install(fake_pynvml())
    reading = read_device(uuid="GPU-abcd")
    assert reading is not None
    assert (reading.index, reading.uuid) == (3, "GPU-abcd")
    assert "nvmlDeviceGetCount" not in mod.calls


def test_d1_nvml_name_as_bytes_from_old_pynvml(install):
    install(fake_pynvml(name=b"NVIDIA H200"))
    reading = read_device()
    assert reading is not None and reading.name == "NVIDIA H200"


def test_d1_device_reading_round_trips_json_and_msgpack(install):
    install(fake_pynvml(compute=[proc(4101, GiB), proc(4102, None)]))
    reading = read_device()
    for codec in (msgspec.json, msgspec.msgpack):
        assert codec.decode(codec.encode(reading), type=DeviceReading) == reading


def test_d1_import_does_not_import_pynvml():
    code = "import sys, shared.probe.nvml; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# device_bytes_for


def test_d1_device_bytes_for_unknown_pid_or_no_reading_is_none():
    reading = DeviceReading(index=0, name="x", total=8 * GiB, free=4 * GiB, used=4 * GiB,
                            per_process={900_001: GiB})  # e.g. a host pid, seen from a container
    assert device_bytes_for(reading, 4101) is None
    assert device_bytes_for(reading, []) is None
    assert device_bytes_for(None, 4101) is None
    assert device_bytes_for(reading, [4101, 900_001, 900_001]) == GiB


# ---------------------------------------------------------------------------
# reading_from_device_info (a CUDA worker's hello)

H200_INFO = {  # keys of mlx 0.32's CUDA device_info (figures illustrative)
    "device_name": "NVIDIA H200", "architecture": "sm_90", "uuid": "GPU-1234",
    "pci_bus_id": "0000:18:00.0", "compute_capability_major": 9, "compute_capability_minor": 0,
    "total_memory": H200_TOTAL, "free_memory": H200_TOTAL - 2 * GiB, "memory_size": 2 * 1024 * GiB,
}
METAL_INFO = {
    "architecture": "applegpu_g14s", "device_name": "Apple M2 Max",
    "max_buffer_size": 17179869184, "max_recommended_working_set_size": 22906503168,
    "memory_size": 34359738368, "resource_limit": 499000,
}


def test_d1_reading_from_cuda_device_info():
    assert reading_from_device_info(H200_INFO) == DeviceReading(
        index=0, name="NVIDIA H200", total=H200_TOTAL, free=H200_TOTAL - 2 * GiB, used=2 * GiB,
        uuid="GPU-1234", source="device_info",
    )


def test_d1_reading_from_device_info_without_free_has_total_only():
    info = {k: v for k, v in H200_INFO.items() if k != "free_memory"}
    reading = reading_from_device_info(info, index=2)
    assert reading is not None
    assert (reading.index, reading.total, reading.free, reading.used) == (2, H200_TOTAL, None, None)


@pytest.mark.parametrize("info", [METAL_INFO, {"architecture": "x86_64", "device_name": "AMD EPYC"}, {}])
def test_d1_reading_from_metal_or_cpu_device_info_is_none(info):
    assert reading_from_device_info(info) is None


@pytest.mark.parametrize("bad", [{"total_memory": -1}, {"total_memory": "lots"}, {"total_memory": True},
                                 {"total_memory": GiB, "free_memory": None}])
def test_d1_reading_from_garbled_device_info_is_none(bad, caplog):
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert reading_from_device_info(bad) is None
    assert len(warnings_logged(caplog)) == 1


def test_d1_reading_from_device_info_free_above_total_is_unknown():
    reading = reading_from_device_info({"total_memory": GiB, "free_memory": 2 * GiB})
    assert reading is not None and reading.free is None and reading.used is None
