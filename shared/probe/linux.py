"""Linux memory probes: /proc/meminfo, the cgroup limit, PSI, process footprints.

How Linux numbers map onto SPEC C2's macOS-shaped formula
---------------------------------------------------------
C2 counts `free + inactive + max(0, file_backed - inactive)` as memory the
OS hands over without harm, and `(active - file_active - own) * ratio` as
other apps' anonymous memory a compressor could squeeze (aggressive tier
only, and only where the OS can compress or swap, T3). On macOS `inactive`
pages are reclaimable because the compressor takes inactive anonymous pages.
On Linux without swap an inactive ANONYMOUS page cannot be reclaimed at all,
so counting `Inactive` (anon + file) would promise memory that does not exist
-- the over-optimistic ceiling that let the seed's machines run out. So:

    free        = MemFree
    inactive    = Inactive(file)                  page cache the kernel drops first
    file_backed = Active(file) + Inactive(file)   => file_active = Active(file)
    active      = Active(anon) + Active(file)     => active - file_active = Active(anon)
    available   = MemAvailable                    (only used when the above are missing)
    compressor  = SwapTotal > 0

Inactive(anon) is counted nowhere, even with swap: pushing it to a swap
device is far costlier than macOS compression, and leaving it out only makes
the ceiling more cautious. Shmem/tmpfs pages live on the anon lists and are
(correctly) not counted as file cache. zram and zswap need no separate test
for T3: zram takes anonymous pages only as a swap device (so it is in
SwapTotal) and zswap is a cache in front of a swap device.

Inside a container whose memory limit is below the physical RAM, the same
counters describe the container, from its cgroup's memory.stat:

    free        = min(limit - usage, host MemFree)
    inactive    = inactive_file;  file_backed = active_file + inactive_file
    active      = active_anon + active_file
    compressor  = host swap > 0 and the cgroup may swap (v2 memory.swap.max,
                  v1 memsw limit above the memory limit)

`limit` is the smallest limit on the path from the process's cgroup to the
mount's root (cgroup v2 `memory.max`/`memory.high`, v1 `memory.limit_in_bytes`),
and `usage`/`memory.stat` come from the cgroup that sets it, since that
subtree is what the kernel holds to the limit.

Speed: every file is opened once and re-read with `os.pread` from offset 0
(procfs and cgroupfs regenerate the text on each read); bytes are searched
with `find`, no regex, no dict of every field. The cgroup layout and limit,
which change rarely, are refreshed every `slow_interval` seconds.

Footprint: SPEC U1 asks for private resident memory, not RSS (RSS counts
shared file pages). The exact figure, USS from /proc/PID/smaps_rollup, makes
the kernel walk every page table entry of the process: measured here at
150 µs for an idle Python, 10 ms per GiB resident (37 ms at 4 GiB). On the
tick path that cost would grow with the models, eight workers of 4 GiB
costing a third of a core at a 1 s tick. `footprint` therefore reads
/proc/PID/statm, O(1) kernel counters: resident - shared = the process's
anonymous resident pages (RssAnon), which is its private memory for workers
that are spawned, not forked (no copy-on-write sharing), and, like macOS
`phys_footprint`, leaves out clean file pages the kernel can drop.
`exact_footprint` returns the smaps_rollup USS (Private_Clean +
Private_Dirty + Private_Hugetlb) for `probe` and occasional checks.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable

import msgspec

from shared.host import HostCounters
from shared.probe.base import (
    HostReading,
    ProbeError,
    Psi,
    TotalSource,
    choose_total,
    warn_once,
)
from shared.probe.cgroups import Container, find_container
from shared.probe.procfs import (
    ALL_FIELDS,
    TICK_FIELDS,
    CgroupStat,
    Meminfo,
    ProcFile,
    parse_cgroup_stat,
    parse_counter,
    parse_meminfo,
    parse_psi,
    parse_smaps_rollup,
    parse_statm,
    read_once,
    under,
)

_MAX_FDS = 512


# ---------------------------------------------------------------------------
# From readings to SPEC C2 counters (pure).


def host_counters(mi: Meminfo, total: int) -> tuple[HostCounters, str | None]:
    """SPEC C2 counters from /proc/meminfo (mapping in the module docstring).

    Returns the counters and, when they had to fall back, why.
    """
    compressor = bool(mi.swap_total)
    if (mi.free is not None and mi.active_anon is not None and mi.active_file is not None
            and mi.inactive_file is not None):
        return HostCounters(
            total=total, free=mi.free, inactive=mi.inactive_file,
            file_backed=mi.active_file + mi.inactive_file,
            active=mi.active_anon + mi.active_file,
            available=mi.available, compressor=compressor,
        ), None
    if mi.available is not None:
        return HostCounters(total=total, available=mi.available, compressor=compressor), (
            "/proc/meminfo lacks MemFree/Active/Inactive(file) fields: using MemAvailable only"
        )
    return HostCounters(total=total, compressor=compressor), (
        "/proc/meminfo has neither the page counters nor MemAvailable: "
        "dynamic ceiling falls back to static"
    )


def container_counters(
    mi: Meminfo, stat: CgroupStat, limit: int, usage: int, total: int, swap_allowed: bool | None
) -> tuple[HostCounters, str | None]:
    """SPEC C2 counters for a container whose limit is below the RAM."""
    free = max(0, limit - usage)
    if mi.free is not None:
        free = min(free, mi.free)
    compressor = bool(mi.swap_total) and swap_allowed is not False
    if stat.active_anon is None or stat.active_file is None or stat.inactive_file is None:
        return HostCounters(total=total, available=free, compressor=compressor), (
            "cgroup memory.stat lacks active/inactive file and anon fields: "
            "using limit - usage as available"
        )
    available = free + stat.inactive_file
    if mi.available is not None:
        available = min(available, mi.available)
    return HostCounters(
        total=total, free=free, inactive=stat.inactive_file,
        file_backed=stat.active_file + stat.inactive_file,
        active=stat.active_anon + stat.active_file,
        available=available, compressor=compressor,
    ), None


# ---------------------------------------------------------------------------
# The probe.


class _Sample(msgspec.Struct, kw_only=True):
    """One tick's raw readings, before they become counters or a report."""

    mi: Meminfo
    physical: int
    container: Container | None
    usage: int | None = None
    stat: CgroupStat | None = None
    counters: HostCounters | None = None
    total_source: TotalSource = "physical"
    warnings: list[str] = []


class LinuxProbe:
    """Reads the host (and its container) through files kept open.

    `root` prefixes every path, so tests point the probe at a directory of
    captured files laid out like / (proc/meminfo, proc/self/cgroup,
    sys/fs/cgroup/...). `clock` drives the slow-refresh cadence.
    """

    def __init__(
        self,
        root: str = "/",
        slow_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.slow_interval = slow_interval
        self._clock = clock
        self._meminfo = ProcFile(under(root, "proc/meminfo"))
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        self._physical_fallback = 0
        self._next_slow = float("-inf")
        self._container: Container | None = None
        self._container_error: str | None = None
        self._usage: ProcFile | None = None
        self._stat: ProcFile | None = None
        self._statm: dict[int, ProcFile] = {}
        # The enforcer and a status request may read at once; one closing a
        # descriptor the other is reading would leak a reopened one.
        self._lock = threading.Lock()
        _live_probes.add(self)

    # -- slow path ---------------------------------------------------------

    def _refresh_slow(self) -> None:
        """Re-find the cgroup and its limit; keep the last good one on error."""
        self._next_slow = self._clock() + self.slow_interval
        try:
            found = find_container(self.root)
        except (ProbeError, OSError, ValueError) as exc:
            self._container_error = f"container limit unknown: {exc}"
            return
        self._container_error = None
        if found != self._container:
            self._close_container()
            self._container = found
            if found is not None and found.limit is not None:
                usage = "memory.current" if found.version == 2 else "memory.usage_in_bytes"
                self._usage = ProcFile(os.path.join(found.dir, usage))
                self._stat = ProcFile(os.path.join(found.dir, "memory.stat"))

    def _close_container(self) -> None:
        for f in (self._usage, self._stat):
            if f is not None:
                f.close()
        self._usage = self._stat = None

    def _physical(self, mi: Meminfo) -> int:
        if mi.total:
            return mi.total
        if not self._physical_fallback:
            self._physical_fallback = int(os.sysconf("SC_PHYS_PAGES")) * self._page_size
        return self._physical_fallback

    # -- tick path ---------------------------------------------------------

    def _sample(self, budget: int, fields: tuple[tuple[bytes, str], ...] = TICK_FIELDS) -> _Sample:
        if self._clock() >= self._next_slow:
            self._refresh_slow()
        warnings: list[str] = []
        meminfo_ok = True
        try:
            mi = parse_meminfo(self._meminfo.read(), fields)
        except ProbeError as exc:
            mi, meminfo_ok = Meminfo(), False
            warnings.append(warn_once(f"meminfo:{exc}", f"{exc}: host counters unavailable"))
        if self._container_error:
            warnings.append(warn_once(self._container_error, self._container_error))
        sample = _Sample(mi=mi, physical=self._physical(mi), container=self._container,
                         warnings=warnings)
        limit = sample.container.limit if sample.container else None
        total, sample.total_source = choose_total(sample.physical, limit, max(0, budget))
        if limit is not None and limit < sample.physical:
            sample.counters = self._container_sample(sample, limit, total)
        if sample.counters is None:
            sample.counters, why = host_counters(mi, total)
            if why and meminfo_ok:
                warnings.append(warn_once(why, why))
        return sample

    def _container_sample(self, sample: _Sample, limit: int, total: int) -> HostCounters | None:
        assert self._usage is not None and self._stat is not None and sample.container
        try:
            sample.usage = parse_counter(self._usage.read(), self._usage.path)
            sample.stat = parse_cgroup_stat(self._stat.read(), sample.container.version)
        except ProbeError as exc:
            message = f"{exc}: using host counters under the container limit"
            sample.warnings.append(warn_once(f"cgroup:{exc}", message))
            return None
        counters, why = container_counters(
            sample.mi, sample.stat, limit, sample.usage, total, sample.container.swap_allowed
        )
        if why:
            sample.warnings.append(warn_once(why, why))
        return counters

    def counters(self, budget: int = 0) -> HostCounters:
        with self._lock:
            counters = self._sample(budget).counters
        assert counters is not None
        return counters

    def reading(self, budget: int = 0) -> HostReading:
        with self._lock:
            sample = self._sample(budget, ALL_FIELDS)
        return build_reading(self.root, sample, max(0, budget))

    # -- footprints --------------------------------------------------------

    def footprint(self, pid: int) -> int | None:
        """Anonymous resident bytes of `pid` (see the module docstring)."""
        with self._lock:
            return self._footprint(pid)

    def _footprint(self, pid: int) -> int | None:
        f = self._statm.get(pid)
        if f is None:
            if len(self._statm) >= _MAX_FDS:
                self._drop(next(iter(self._statm)))
            f = self._statm[pid] = ProcFile(under(self.root, f"proc/{pid}/statm"))
        try:
            value = parse_statm(f.read(), self._page_size)
        except ProbeError:
            value = None
        if value is None:
            self._drop(pid)  # gone (or reused: the old descriptor never follows)
        return value

    def exact_footprint(self, pid: int) -> int | None:
        """USS from /proc/PID/smaps_rollup; slow, for `probe` and spot checks."""
        try:
            return parse_smaps_rollup(read_once(under(self.root, f"proc/{pid}/smaps_rollup")))
        except ProbeError:
            return None

    def forget(self, pid: int) -> None:
        """Close the descriptor kept for `pid` now (reads of a gone pid drop it anyway)."""
        with self._lock:
            self._drop(pid)

    def _drop(self, pid: int) -> None:
        f = self._statm.pop(pid, None)
        if f is not None:
            f.close()

    def _forget_all(self) -> None:
        """After fork the child must not read the parent's open files.

        Runs in the child right after fork, when no other thread exists: the
        lock may have been copied held, so it is replaced, not taken.
        """
        self._lock = threading.Lock()
        for pid in list(self._statm):
            self._drop(pid)
        self._meminfo.close()
        self._close_container()
        self._container = None
        self._next_slow = float("-inf")


# After fork a child must not read through its parent's descriptors (the
# parent's /proc/<pid> files would describe the parent). Weak references, so
# a probe made in a test is not kept alive by the hook.
_live_probes: weakref.WeakSet[LinuxProbe] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for probe in list(_live_probes):
        probe._forget_all()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------
# The full report (slow path: `probe`, status, `tiers`).


def read_swap_kinds(root: str = "/") -> tuple[bool | None, bool | None]:
    """(zram active as swap, zswap enabled); None where the system does not say."""
    try:
        swaps = read_once(under(root, "proc/swaps")).decode(errors="replace").splitlines()[1:]
        zram: bool | None = any(line.split()[0].startswith("/dev/zram") for line in swaps if line)
    except ProbeError:
        zram = None
    try:
        flag = read_once(under(root, "sys/module/zswap/parameters/enabled")).strip()
        zswap: bool | None = flag in (b"Y", b"y", b"1")
    except ProbeError:
        zswap = None
    return zram, zswap


def read_psi(root: str, container: Container | None) -> tuple[Psi | None, str | None]:
    """Memory PSI: the binding v2 cgroup's own file, else the host's."""
    path = under(root, "proc/pressure/memory")
    if container is not None and container.version == 2 and container.limit is not None:
        own = os.path.join(container.dir, "memory.pressure")
        if os.path.exists(own):
            path = own
    if not os.path.exists(path):
        return None, None  # kernel without PSI: nothing to report, nothing wrong
    try:
        return parse_psi(read_once(path), path), None
    except ProbeError as exc:
        return None, f"{exc} (PSI disabled on this kernel?)"


def _host_sources(meminfo: str) -> dict[str, str]:
    return {
        "free": f"{meminfo} MemFree",
        "inactive": f"{meminfo} Inactive(file)",
        "file_backed": f"{meminfo} Active(file) + Inactive(file)",
        "active": f"{meminfo} Active(anon) + Active(file)",
        "available": f"{meminfo} MemAvailable",
        "compressor": f"{meminfo} SwapTotal > 0",
    }


def _container_sources(meminfo: str, c: Container) -> dict[str, str]:
    usage = os.path.join(c.dir, "memory.current" if c.version == 2 else "memory.usage_in_bytes")
    stat = os.path.join(c.dir, "memory.stat")
    p = "" if c.version == 2 else "total_"
    swap = "memory.swap.max" if c.version == 2 else "memory.memsw.limit_in_bytes"
    return {
        "free": f"min({c.limit_source} - {usage}, {meminfo} MemFree)",
        "inactive": f"{stat} {p}inactive_file",
        "file_backed": f"{stat} {p}active_file + {p}inactive_file",
        "active": f"{stat} {p}active_anon + {p}active_file",
        "available": f"min(free + {p}inactive_file, {meminfo} MemAvailable)",
        "compressor": f"{meminfo} SwapTotal > 0 and {os.path.join(c.dir, swap)}",
        "container_usage": usage,
    }


def _sources(root: str, sample: _Sample) -> dict[str, str]:
    meminfo = under(root, "proc/meminfo")
    c = sample.container
    if sample.stat is not None and c is not None:
        sources = _container_sources(meminfo, c)
    else:
        sources = _host_sources(meminfo)
    counters = sample.counters
    assert counters is not None
    for name in ("free", "inactive", "file_backed", "active", "available"):
        if getattr(counters, name) is None:
            sources[name] = "unavailable"
    sources["physical_total"] = (
        f"{meminfo} MemTotal" if sample.mi.total else "sysconf(SC_PHYS_PAGES) * sysconf(SC_PAGE_SIZE)"
    )
    if c is not None and c.limit is not None:
        sources["container_limit"] = c.limit_source
    sources["swap_total"] = f"{meminfo} SwapTotal"
    sources["total"] = {
        "physical": sources["physical_total"],
        "container": sources.get("container_limit", ""),
        "budget": "the configured budget",
    }[sample.total_source]
    return sources


def _detail(mi: Meminfo, stat: CgroupStat | None) -> dict[str, int]:
    detail = {
        f"meminfo_{name}": value
        for name, value in (
            ("available", mi.available), ("active_anon", mi.active_anon),
            ("inactive_anon", mi.inactive_anon), ("active_file", mi.active_file),
            ("inactive_file", mi.inactive_file), ("shmem", mi.shmem),
            ("unevictable", mi.unevictable), ("swap_free", mi.swap_free),
        )
        if value is not None
    }
    if stat is not None:
        for name in ("anon", "file", "shmem", "inactive_anon"):
            value = getattr(stat, name)
            if value is not None:
                detail[f"cgroup_{name}"] = value
    return detail


def build_reading(root: str, sample: _Sample, budget: int) -> HostReading:
    warnings = list(sample.warnings)
    psi, psi_warning = read_psi(root, sample.container)
    if psi_warning:
        warnings.append(warn_once(psi_warning, psi_warning))
    zram, zswap = read_swap_kinds(root)
    c = sample.container
    assert sample.counters is not None
    return HostReading(
        platform="linux",
        counters=sample.counters,
        physical_total=sample.physical,
        container_limit=c.limit if c is not None else None,
        container_usage=sample.usage,
        cgroup=f"v{c.version} {c.dir}" if c is not None else None,
        budget=budget,
        total_source=sample.total_source,
        swap_total=sample.mi.swap_total,
        zram=zram,
        zswap=zswap,
        psi=psi,
        detail=_detail(sample.mi, sample.stat),
        sources=_sources(root, sample),
        warnings=warnings,
    )
