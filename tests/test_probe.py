"""The platform-neutral probe door (SPEC C inputs, C2 fallbacks, C4 GPU caps,
U1) and `python -m supervisor probe`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import msgspec
import pytest

from shared import probe
from shared.host import HostCounters
from shared.probe import (
    HostReading,
    MiB,
    choose_total,
    gpu_cap_from_device_info,
    gpu_kind,
    gpu_share_of_usage,
)
from supervisor.cli import main

GiB = 1024**3

# Recorded `mx.device_info()` answers.
METAL_M2_MAX = {  # Apple M2 Max, 32 GiB
    "architecture": "applegpu_g14s", "device_name": "Apple M2 Max",
    "max_buffer_size": 17179869184, "max_recommended_working_set_size": 22906503168,
    "memory_size": 34359738368, "resource_limit": 499000,
}
CUDA_4090 = {  # keys of mlx/backend/cuda/device_info.cpp
    "device_name": "NVIDIA GeForce RTX 4090", "architecture": "sm_89",
    "uuid": "GPU-0b0c8a2e-3a0c-5d1e-9f1b-1c2d3e4f5a6b", "pci_bus_id": "0000:01:00.0",
    "compute_capability_major": 8, "compute_capability_minor": 9,
    "free_memory": 24_000_000_000, "total_memory": 25_757_220_864,
}
CPU_THIS_MACHINE = {"architecture": "x86_64", "device_name": "AMD EPYC"}  # mlx 0.32 here


@pytest.fixture(autouse=True)
def fresh_warnings():
    probe._warned.clear()
    yield
    probe._warned.clear()


# ---------------------------------------------------------------------------
# total = min(physical, container limit, budget)


@pytest.mark.parametrize(
    ("physical", "container", "budget", "want"),
    [
        (32 * GiB, None, 0, (32 * GiB, "physical")),
        (32 * GiB, 8 * GiB, 0, (8 * GiB, "container")),
        (32 * GiB, 8 * GiB, 4 * GiB, (4 * GiB, "budget")),
        (32 * GiB, 4 * GiB, 8 * GiB, (4 * GiB, "container")),
        (32 * GiB, 64 * GiB, 0, (32 * GiB, "physical")),     # a limit above the RAM
        (32 * GiB, None, 32 * GiB, (32 * GiB, "physical")),  # a tie does not claim to bind
        (32 * GiB, 0, -1, (32 * GiB, "physical")),           # 0 / negative are "none"
    ],
)
def test_c_total_is_the_smallest_of_physical_container_budget(physical, container, budget, want):
    assert choose_total(physical, container, budget) == want


# ---------------------------------------------------------------------------
# Never an exception into the enforcer


class _Broken:
    def counters(self, budget=0):
        raise RuntimeError("probe bug")

    def reading(self, budget=0):
        raise RuntimeError("probe bug")

    def footprint(self, pid):
        raise RuntimeError("probe bug")

    def exact_footprint(self, pid):
        raise RuntimeError("probe bug")


def test_c2_a_failing_backend_gives_the_static_fallback_with_one_warning(monkeypatch, caplog):
    """The seed's enforcer loop died on one unexpected probe error and the
    guard silently stopped guarding; a reading must degrade, not raise."""
    monkeypatch.setattr(probe, "_backend", _Broken())
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        readings = [probe.read_host_counters(budget=4 * GiB) for _ in range(5)]
        full = probe.read_host()
        fp = probe.footprint(os.getpid())
    assert all(r == HostCounters(total=4 * GiB) for r in readings)
    assert full.counters.free is None and full.warnings
    assert fp is None
    assert len([r for r in caplog.records if "failed unexpectedly" in r.message]) == 1


def test_c2_platform_without_a_probe_falls_back_to_static(monkeypatch, caplog):
    monkeypatch.setattr(probe, "_backend", probe._PhysicalOnly())
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        counters = [probe.read_host_counters() for _ in range(3)]
    assert counters[0].total == probe._sysconf_physical()
    assert counters[0].free is None and counters[0].available is None
    assert len(caplog.records) == 1


def test_this_machine_gets_the_linux_backend():
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    from shared.probe.linux import LinuxProbe

    assert isinstance(probe._make_backend(), LinuxProbe)


def test_u1_own_footprint_is_this_process():
    if not sys.platform.startswith("linux"):
        pytest.skip("checked against /proc")
    own = probe.own_footprint()
    assert own is not None and own > 0
    assert probe.footprint(os.getpid()) == pytest.approx(own, abs=8 * MiB)


def test_probe_import_stays_light_for_workers():
    """Workers import shared.probe to measure themselves: it must not drag
    in MLX, psutil or the supervisor's transport and HTTP stacks."""
    code = (
        "import sys, shared.probe as p; p.own_footprint(); p.read_host_counters();"
        "print(sorted(m for m in ('mlx', 'psutil', 'zmq', 'starlette', 'uvicorn', 'rich',"
        " 'multiprocess') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------
# GPU caps (C4) from a worker's mx.device_info()


def test_c4_metal_cap_is_the_recommended_working_set_when_unwired(monkeypatch):
    monkeypatch.setattr(probe, "_wired_limit_mb", lambda: 0)
    assert gpu_kind(METAL_M2_MAX) == "metal"
    assert gpu_cap_from_device_info(METAL_M2_MAX) == 22906503168


def test_c4_metal_cap_is_the_wired_limit_when_the_user_set_one(monkeypatch):
    """Above iogpu.wired_limit_mb Metal refuses to wire: planning past it
    panicked machines in the seed."""
    monkeypatch.setattr(probe, "_wired_limit_mb", lambda: 28672)
    assert gpu_cap_from_device_info(METAL_M2_MAX) == 28672 * MiB


def test_c4_cuda_cap_is_total_device_memory(monkeypatch):
    monkeypatch.setattr(probe, "_wired_limit_mb", lambda: 28672)  # never consulted for CUDA
    assert gpu_kind(CUDA_4090) == "cuda"
    assert gpu_cap_from_device_info(CUDA_4090) == 25_757_220_864


def test_c4_cpu_has_no_gpu_cap():
    assert gpu_kind(CPU_THIS_MACHINE) == "cpu"
    assert gpu_cap_from_device_info(CPU_THIS_MACHINE) == 0
    assert gpu_cap_from_device_info({}) == 0


@pytest.mark.parametrize(
    "info",
    [{"max_recommended_working_set_size": "lots"}, {"max_recommended_working_set_size": -5},
     {"total_memory": True}, {"total_memory": [1]}, "not a dict"],
)
def test_c4_garbage_device_info_is_no_cap_not_a_crash(info, monkeypatch, caplog):
    monkeypatch.setattr(probe, "_wired_limit_mb", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert gpu_cap_from_device_info(info) == 0  # type: ignore[arg-type]


def test_c_gpu_share_is_the_mlx_buffers_on_metal_only():
    assert gpu_share_of_usage(METAL_M2_MAX, 3 * GiB, GiB) == 4 * GiB
    assert gpu_share_of_usage(CUDA_4090, 3 * GiB, GiB) == 0  # separate pool (SPEC C)
    assert gpu_share_of_usage(CPU_THIS_MACHINE, 3 * GiB, GiB) == 0


# ---------------------------------------------------------------------------
# python -m supervisor probe


def test_probe_json_reports_every_number_with_its_source(capsys, tmp_path):
    assert main(["probe", "--json", "--runtime-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    own = out.pop("own")
    out.pop("device")              # SPEC D6: the NVIDIA device's reading (tests/test_d_device_status.py) ...
    out.pop("device_unavailable")  # ... or why there is none
    out.pop("blas")                # the BLAS workers get (tests/test_blas.py)
    reading = msgspec.convert(out, HostReading)  # the rest is exactly a HostReading
    assert reading.physical_total > 0
    for key in ("free", "inactive", "file_backed", "active", "available", "total",
                "physical_total", "compressor"):
        assert reading.sources[key]
    assert own["pid"] == os.getpid()
    assert own["footprint"] > 0 and own["footprint_source"]


def test_probe_budget_flag_binds_total(capsys, tmp_path):
    assert main(["probe", "--json", "--budget", "1GiB", "--runtime-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["counters"]["total"], out["total_source"], out["budget"]) == (GiB, "budget", GiB)


def test_probe_table_for_people(capsys, tmp_path):
    assert main(["probe", "--runtime-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("total", "free", "inactive", "file-backed", "can compress/swap (T3)",
                  "own footprint"):
        assert label in out
    if sys.platform.startswith("linux"):
        assert "/proc/meminfo MemFree" in out


def test_probe_bad_budget_is_a_clear_error_not_a_traceback(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["probe", "--budget", "8XB", "--runtime-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--budget" in err and "unknown unit 'XB'" in err and "Traceback" not in err
