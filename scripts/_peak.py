"""Peak memory of a server while a benchmark round runs: host RSS and USS, and on an NVIDIA GPU
the device bytes of the whole GPU and of the server's own processes (NVML).

Why both on a GPU: NVML's per-process figures are what each process holds,
but inside many containers it names host pids that match none of ours (or
none at all); the whole GPU's used bytes always exist, and with one server on
the device at a time their rise over the baseline read before it started is
that server's. Why USS beside RSS on the CPU: RSS counts the shared libraries
(MLX, numpy, OpenBLAS) once per process, so a server of two processes (a
supervisor and a worker) pays them twice in RSS; USS is what each process
alone holds, what the machine gets back when it exits.

Sampled on a thread every `every` seconds (USS, which reads smaps, every
`uss_every`); nothing here raises into the benchmark.
"""

from __future__ import annotations

import threading
from typing import Any

import psutil


def gpu_used() -> int | None:
    """The whole GPU's used bytes now, or None without an NVIDIA device (NVML)."""
    from shared.probe import nvml

    reading = nvml.read_device()
    return None if reading is None else reading.used or 0


class Peak:
    """The peaks of one server (the process `pid` and its children) between enter and exit."""

    def __init__(self, pid: int, *, gpu: bool, every: float = 0.05, uss_every: float = 0.25) -> None:
        self.root = psutil.Process(pid)
        self.gpu, self.every, self.uss_every = gpu, every, uss_every
        self.rss = self.uss = 0
        self.gpu_total = 0       # the whole GPU's used bytes
        self.gpu_procs: int | None = None  # NVML's bytes of the server's pids (None: it named none of them)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def procs(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return [self.root]

    def sample(self, uss: bool) -> None:
        rss = uss_bytes = 0
        procs = self.procs()
        for proc in procs:
            try:
                if uss:
                    full = proc.memory_full_info()
                    rss, uss_bytes = rss + full.rss, uss_bytes + full.uss
                else:
                    rss += proc.memory_info().rss
            except psutil.Error:
                pass
        self.rss = max(self.rss, rss)
        self.uss = max(self.uss, uss_bytes)
        if self.gpu:
            self._sample_gpu({p.pid for p in procs})

    def _sample_gpu(self, pids: set[int]) -> None:
        from shared.probe import nvml

        reading = nvml.read_device()
        if reading is None:
            return
        self.gpu_total = max(self.gpu_total, reading.used or 0)
        mine = [b for pid, b in reading.per_process.items() if pid in pids]
        if mine:
            self.gpu_procs = max(self.gpu_procs or 0, sum(mine))

    def _run(self) -> None:
        ticks_per_uss = max(1, round(self.uss_every / self.every))
        tick = 0
        while not self._stop.wait(self.every):
            tick += 1
            self.sample(uss=tick % ticks_per_uss == 0)

    def __enter__(self) -> Peak:
        self.sample(uss=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample(uss=True)

    def figures(self, baseline: int | None) -> dict[str, float | None]:
        """GiB: host RSS and USS; with a GPU the whole GPU's peak, its rise over `baseline`
        (read before the server started) and NVML's per-process peak (None where it named none)."""
        gib = 2**30
        out: dict[str, float | None] = {"rss_gib": self.rss / gib, "uss_gib": self.uss / gib}
        if self.gpu:
            out["gpu_total_gib"] = self.gpu_total / gib
            out["gpu_over_baseline_gib"] = max(0, self.gpu_total - (baseline or 0)) / gib
            out["gpu_procs_gib"] = None if self.gpu_procs is None else self.gpu_procs / gib
        return out
