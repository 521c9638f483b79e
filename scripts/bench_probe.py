"""Time the guard's per-tick readings against psutil's equivalents.

    python scripts/bench_probe.py [--repeats 7] [--worker-size 1GiB]

Measures, in one run on this machine:
  * one host reading (`shared.probe.read_host_counters`) vs
    `psutil.virtual_memory()`;
  * one per-process footprint (`shared.probe.footprint`) vs
    `psutil.Process(pid).memory_full_info()` (psutil's USS), for this process
    and for a child holding `--worker-size` of touched memory, like a worker
    with a model loaded -- plus the exact smaps_rollup USS, whose cost grows
    with the process's resident memory.
Each figure is the median over `--repeats` batches of the per-call average.
Goals: host reading <= 20 µs, footprint <= 30 µs per worker, both
faster than psutil. The last line is `host probe: X µs (psutil Y µs)`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from shared import probe  # noqa: E402
from shared.sizes import SizeError, format_size, parse_size  # noqa: E402


def per_call_us(fn: Callable[[], object], repeats: int, budget_s: float = 0.2) -> float:
    """Median over `repeats` batches of the mean time per call, in µs."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.02 or calls < 3:  # size a batch to ~budget_s
        fn()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    n = max(3, min(20000, int(budget_s / per_call)))
    batches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        batches.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(batches)


def start_worker(size: int) -> subprocess.Popen[bytes]:
    """A child process holding `size` bytes of touched anonymous memory."""
    code = (
        "import sys; b = bytearray(int(sys.argv[1])); "
        "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def row(name: str, ours: float, theirs: float | None = None, label: str = "psutil") -> None:
    tail = "" if theirs is None else f"   {label} {theirs:9.1f} µs   x{theirs / ours:.1f}"
    print(f"{name:<54} {ours:9.1f} µs{tail}")


def bench_footprints(pid: int, what: str, repeats: int) -> None:
    proc = psutil.Process(pid)
    fast = per_call_us(lambda: probe.footprint(pid), repeats)
    full = per_call_us(proc.memory_full_info, repeats)
    exact = per_call_us(lambda: probe.exact_footprint(pid), repeats)
    row(f"footprint, {what}", fast, full, "memory_full_info")
    row(f"exact footprint (smaps_rollup USS), {what}", exact)
    print(f"{'':<54} footprint {format_size(probe.footprint(pid) or 0)}, "
          f"USS {format_size(probe.exact_footprint(pid) or 0)}, "
          f"psutil USS {format_size(proc.memory_full_info().uss)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker-size", default="1GiB",
                        help="memory the simulated worker holds (0 to skip)")
    args = parser.parse_args()
    try:
        worker_size = parse_size(args.worker_size)
    except SizeError as exc:
        parser.error(f"--worker-size: {exc}")

    print(f"{sys.platform}, {os.cpu_count()} CPUs, {format_size(psutil.virtual_memory().total)}, "
          f"psutil {psutil.__version__}; median of {args.repeats} batches")
    host = per_call_us(probe.read_host_counters, args.repeats)
    ps_host = per_call_us(psutil.virtual_memory, args.repeats)
    row("host reading (read_host_counters)", host, ps_host, "virtual_memory")
    row("full report (read_host, for `probe`)", per_call_us(probe.read_host, args.repeats))

    bench_footprints(os.getpid(), "this process", args.repeats)
    if worker_size:
        child = start_worker(worker_size)
        try:
            bench_footprints(child.pid, f"worker holding {format_size(worker_size)}",
                             args.repeats)
        finally:
            child.communicate(b"")
    print(f"host probe: {host:.1f} µs (psutil {ps_host:.1f} µs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
