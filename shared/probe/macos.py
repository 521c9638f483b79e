"""macOS memory probes through ctypes: no subprocess on the polling path.

Calls (all in libSystem, loaded once):

* `host_statistics64(mach_host_self(), HOST_VM_INFO64, buf, &count)` -- the
  page counters of SPEC C2. free = free_count (the kernel already includes
  speculative pages in it), inactive = inactive_count, file_backed =
  external_page_count, active = active_count, in pages of
  `host_page_size()` (the kernel's page, 16 KiB on Apple silicon even for a
  process whose own page is 4 KiB).
* `sysctlbyname("hw.memsize")` -- physical RAM.
* `proc_pid_rusage(pid, RUSAGE_INFO_V4, buf)` -- `ri_phys_footprint`, the
  footprint of SPEC U1 (what Activity Monitor shows as Memory; it counts
  Metal buffers and compressed pages and leaves out clean file pages).
* `sysctlbyname("iogpu.wired_limit_mb")` -- the user's GPU wired cap (C4).
* the same host_statistics64 call's `wire_count` (what `vm_stat` prints as
  "Pages wired down") x the page size: the OS's wired memory, which the
  guard re-reads after every worker exit (M3, `MacProbe.wired_bytes`).

Layouts, from apple-oss-distributions/xnu:

* `struct vm_statistics64`, osfmk/mach/vm_statistics.h: four natural_t
  (free, active, inactive, wire), nine uint64 (zero_fill, reactivations,
  pageins, pageouts, faults, cow_faults, lookups, hits, purges), two
  natural_t (purgeable, speculative) = revision 0, 96 bytes; then rev1:
  four uint64 (decompressions, compressions, swapins, swapouts), four
  natural_t (compressor_page_count, throttled, external_page_count,
  internal_page_count), one uint64 (total_uncompressed_pages_in_compressor)
  = 152 bytes = HOST_VM_INFO64_REV1_COUNT 38 integer_t words. Newer kernels
  append rev2 (swapped_count) and rev3 (memory-tagging pages).
* `struct rusage_info_v4`, bsd/sys/resource.h: uint8 ri_uuid[16] then
  uint64 fields; ri_phys_footprint is the 8th (byte offset 72, the same in
  every version since v0); ri_lifetime_max_phys_footprint is at 248; the
  struct is 296 bytes.

The count passed to host_statistics64 (osfmk/kern/host.c, vm_stats and
rate_limit_host_statistics): the buffer has room for HOST_INFO64_MAX words,
but the count we pass is REV1 (38) -- every field we read is in rev1. A
count above the kernel's own HOST_VM_INFO64_COUNT makes newer kernels log
"count is larger than expected ... likely to result in memory corruption"
on every call, so the buffer's capacity is never passed as the count. When a
kernel answers MIG_ARRAY_TOO_LARGE (seen on macOS 27 betas once the
per-process rate limit serves a cached, larger revision), the MIG stub has
put the kernel's count in `count`: if that fits the buffer we retry once
with it and keep using it. Note the same rate limit: a non-Apple process
polling faster than a few times a second gets cached counters up to 1 s old.

None of this runs on the Linux CI machine; tests/test_probe_macos.py drives
it with byte-exact recorded structures and faked calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from typing import Any

import msgspec

from shared.host import HostCounters
from shared.probe.base import HostReading, ProbeError, TotalSource, choose_total, warn_once

HOST_VM_INFO64 = 4
KERN_SUCCESS = 0
MIG_ARRAY_TOO_LARGE = -307
HOST_VM_INFO64_REV0_COUNT = 24     # words (integer_t) of revision 0
HOST_VM_INFO64_REV1_COUNT = 38     # words of revision 1: every field read here
HOST_INFO64_MAX = 256              # the buffer's capacity, in words
RUSAGE_INFO_V4 = 4
RUSAGE_INFO_V4_SIZE = 296
RUSAGE_PHYS_FOOTPRINT_OFFSET = 72
RUSAGE_LIFETIME_MAX_FOOTPRINT_OFFSET = 248

# Native byte order, no padding: offsets are exactly the C layout's above.
VM_STATS_REV0 = struct.Struct("=4I9Q2I")        # 96 bytes
VM_STATS_REV1_TAIL = struct.Struct("=4Q4IQ")    # 56 bytes at offset 96
assert VM_STATS_REV0.size == HOST_VM_INFO64_REV0_COUNT * 4
assert VM_STATS_REV0.size + VM_STATS_REV1_TAIL.size == HOST_VM_INFO64_REV1_COUNT * 4


class VmStats(msgspec.Struct, frozen=True, kw_only=True):
    """host_statistics64 page counts (not bytes); rev1 fields None if absent."""

    free: int
    active: int
    inactive: int
    wired: int
    purgeable: int
    speculative: int
    compressor: int | None = None     # pages holding compressed data
    throttled: int | None = None
    external: int | None = None       # file-backed pages
    internal: int | None = None       # anonymous pages
    count: int = 0                    # words the kernel filled


def parse_vm_statistics64(raw: bytes, count: int) -> VmStats:
    """Decode `count` words of a vm_statistics64 buffer (see module docstring)."""
    if count < HOST_VM_INFO64_REV0_COUNT or len(raw) < VM_STATS_REV0.size:
        raise ProbeError(f"host_statistics64 filled {count} words, fewer than revision 0's 24")
    rev0 = VM_STATS_REV0.unpack_from(raw, 0)
    stats = dict(
        free=rev0[0], active=rev0[1], inactive=rev0[2], wired=rev0[3],
        purgeable=rev0[13], speculative=rev0[14], count=count,
    )
    if count >= HOST_VM_INFO64_REV1_COUNT and len(raw) >= HOST_VM_INFO64_REV1_COUNT * 4:
        tail = VM_STATS_REV1_TAIL.unpack_from(raw, VM_STATS_REV0.size)
        stats.update(compressor=tail[4], throttled=tail[5], external=tail[6], internal=tail[7])
    return VmStats(**stats)


def vm_counters(vm: VmStats, page: int, total: int) -> HostCounters:
    """SPEC C2 counters from the page counts (the seed's own mapping).

    macOS compresses anonymous memory always (the compressor has been on
    since 10.9), so `compressor` is True. Without rev1 there is no file-
    backed count: it stays None and C2 counts it as 0.
    """
    return HostCounters(
        total=total,
        free=vm.free * page,
        inactive=vm.inactive * page,
        file_backed=None if vm.external is None else vm.external * page,
        active=vm.active * page,
        available=(vm.free + vm.inactive) * page,
        compressor=True,
    )


def wired_bytes(vm: VmStats, page: int) -> int:
    """M3: wired memory in bytes: `wire_count` pages (vm_stat's "Pages wired down") x the kernel's page."""
    return vm.wired * page


# ---------------------------------------------------------------------------
# The C calls.


def load_libs() -> Any:
    """libSystem with the prototypes this module calls; macOS only."""
    lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True)
    lib.mach_host_self.argtypes = []
    lib.mach_host_self.restype = ctypes.c_uint32
    lib.host_page_size.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_size_t)]
    lib.host_page_size.restype = ctypes.c_int
    lib.host_statistics64.argtypes = [
        ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)
    ]
    lib.host_statistics64.restype = ctypes.c_int
    lib.sysctlbyname.argtypes = [
        ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_void_p, ctypes.c_size_t,
    ]
    lib.sysctlbyname.restype = ctypes.c_int
    lib.proc_pid_rusage.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.proc_pid_rusage.restype = ctypes.c_int
    return lib


class SysctlMissing(ProbeError):
    """The sysctl does not exist on this machine (ENOENT): not a fault."""


def sysctl_raw(libs: Any, name: str, size: int = 8) -> bytes:
    """A sysctl's bytes; ProbeError naming it when it is missing or fails."""
    buf = (ctypes.c_uint64 * ((size + 7) // 8))()
    length = (ctypes.c_size_t * 1)(size)
    if libs.sysctlbyname(name.encode(), buf, length, None, 0) != 0:
        err = ctypes.get_errno()
        kind = SysctlMissing if err == errno.ENOENT else ProbeError
        raise kind(f"sysctl {name} failed: {os.strerror(err) if err else 'error'}")
    return bytes(buf)[: min(length[0], size)]


def sysctl_int(libs: Any, name: str) -> int:
    """A sysctl holding an int or int64 (the kernel says which by the length)."""
    raw = sysctl_raw(libs, name)
    if len(raw) == 4:
        return int(struct.unpack("=i", raw)[0])
    if len(raw) == 8:
        return int(struct.unpack("=q", raw)[0])
    raise ProbeError(f"sysctl {name} returned {len(raw)} bytes, not an integer")


_default_libs: Any = None
_libs_lock = threading.Lock()


def default_libs() -> Any:
    global _default_libs
    with _libs_lock:
        if _default_libs is None:
            _default_libs = load_libs()
    return _default_libs


def wired_limit_mb(libs: Any = None) -> int:
    """`iogpu.wired_limit_mb`; 0 when unset, absent (Intel, older macOS) or unreadable."""
    try:
        return max(0, sysctl_int(libs or default_libs(), "iogpu.wired_limit_mb"))
    except SysctlMissing:
        return 0
    except (ProbeError, OSError) as exc:
        warn_once(f"wired:{exc}", f"cannot read the GPU wired limit: {exc}")
        return 0


# ---------------------------------------------------------------------------
# The probe.


class MacProbe:
    """host_statistics64 + sysctl + proc_pid_rusage, with buffers made once."""

    def __init__(self, libs: Any = None) -> None:
        self._libs = libs if libs is not None else default_libs()
        self._lock = threading.Lock()  # the buffers below are shared
        self._host = self._libs.mach_host_self()  # once: every call adds a port right
        self._page = self._page_size()
        self._physical = self._memsize()
        self._count = HOST_VM_INFO64_REV1_COUNT
        self._buf = (ctypes.c_uint64 * (HOST_INFO64_MAX // 2))()  # 8-byte aligned
        self._count_arg = (ctypes.c_uint32 * 1)()
        self._rusage = (ctypes.c_uint64 * (RUSAGE_INFO_V4_SIZE // 8))()

    def _page_size(self) -> int:
        out = (ctypes.c_size_t * 1)()
        if self._libs.host_page_size(self._host, out) == KERN_SUCCESS and out[0] > 0:
            return int(out[0])
        return int(os.sysconf("SC_PAGE_SIZE"))

    def _memsize(self) -> int:
        try:
            return sysctl_int(self._libs, "hw.memsize")
        except ProbeError as exc:
            warn_once(f"memsize:{exc}", f"{exc}: physical size from sysconf")
            return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))

    def vm_stats(self) -> VmStats:
        """One host_statistics64 call, retried once on MIG_ARRAY_TOO_LARGE."""
        with self._lock:
            for attempt in (0, 1):
                self._count_arg[0] = self._count
                kr = self._libs.host_statistics64(
                    self._host, HOST_VM_INFO64, self._buf, self._count_arg
                )
                got = int(self._count_arg[0])
                if kr == KERN_SUCCESS:
                    raw = bytes(self._buf)[: min(got, HOST_INFO64_MAX) * 4]
                    return parse_vm_statistics64(raw, got)
                if kr != MIG_ARRAY_TOO_LARGE or attempt:
                    break
                if not HOST_VM_INFO64_REV1_COUNT <= got <= HOST_INFO64_MAX:
                    break  # a size we cannot hold (or nonsense): do not guess
                self._count = got  # the kernel's own size, from now on
        raise ProbeError(f"host_statistics64(HOST_VM_INFO64) returned {kr} (count {got})")

    def _free_only(self) -> int | None:
        """C2's `available` when host_statistics64 fails: the free page count."""
        try:
            return sysctl_int(self._libs, "vm.page_free_count") * self._page
        except ProbeError:
            return None

    def _sample(self, budget: int) -> tuple[HostCounters, VmStats | None, TotalSource, list[str]]:
        total, source = choose_total(self._physical, None, max(0, budget))
        try:
            vm = self.vm_stats()
        except ProbeError as exc:
            available = self._free_only()
            fallback = "free pages only" if available is not None else "static ceiling"
            warning = warn_once(f"vm:{exc}", f"{exc}: dynamic ceiling from {fallback} (SPEC C2)")
            return HostCounters(total=total, available=available), None, source, [warning]
        warnings = []
        if vm.external is None:
            warnings.append(warn_once(
                "vm:rev0", "host_statistics64 gave revision 0 only: no file-backed page count"
            ))
        return vm_counters(vm, self._page, total), vm, source, warnings

    def counters(self, budget: int = 0) -> HostCounters:
        return self._sample(budget)[0]

    def wired_bytes(self) -> int | None:
        """M3: the OS's wired memory (wire_count pages); None when host_statistics64 fails."""
        try:
            return wired_bytes(self.vm_stats(), self._page)
        except ProbeError as exc:
            warn_once(f"wired:{exc}", f"{exc}: stranded wired memory cannot be seen (SPEC M3)")
            return None

    def reading(self, budget: int = 0) -> HostReading:
        counters, vm, source, warnings = self._sample(budget)
        return HostReading(
            platform="darwin",
            counters=counters,
            physical_total=self._physical,
            budget=max(0, budget),
            total_source=source,
            swap_total=self._swap_total(),
            detail=self._detail(vm),
            sources=self._sources(counters, source),
            warnings=warnings,
        )

    def _swap_total(self) -> int | None:
        """vm.swapusage is struct xsw_usage: total, avail, used (uint64) ..."""
        try:
            raw = sysctl_raw(self._libs, "vm.swapusage", 32)
            return struct.unpack_from("=Q", raw, 0)[0] if len(raw) >= 8 else None
        except ProbeError:
            return None

    def _detail(self, vm: VmStats | None) -> dict[str, int]:
        detail: dict[str, int] = {"page_size": self._page}
        if vm is not None:
            for name in ("wired", "speculative", "purgeable", "compressor", "throttled",
                         "internal", "external"):
                value = getattr(vm, name)
                if value is not None:
                    detail[f"vm_{name}"] = value * self._page
        try:
            detail["memorystatus_level"] = sysctl_int(
                self._libs, "kern.memorystatus_vm_pressure_level"
            )
        except ProbeError:
            pass
        return detail

    def _sources(self, counters: HostCounters, source: str) -> dict[str, str]:
        call = "host_statistics64(HOST_VM_INFO64)"
        sources = {
            "physical_total": "sysctl hw.memsize",
            "total": "sysctl hw.memsize" if source == "physical" else "the configured budget",
            "free": f"{call} free_count (includes speculative) x host_page_size",
            "inactive": f"{call} inactive_count x host_page_size",
            "file_backed": f"{call} external_page_count x host_page_size",
            "active": f"{call} active_count x host_page_size",
            "available": f"{call} free_count + inactive_count",
            "compressor": "macOS always compresses anonymous memory",
            "swap_total": "sysctl vm.swapusage",
        }
        if counters.free is None:
            sources["available"] = "sysctl vm.page_free_count" if counters.available else "unavailable"
        for name in ("free", "inactive", "file_backed", "active"):
            if getattr(counters, name) is None:
                sources[name] = "unavailable"
        return sources

    # -- footprints --------------------------------------------------------

    def footprint(self, pid: int) -> int | None:
        """`ri_phys_footprint`; None when the process is gone or not ours."""
        with self._lock:
            if self._libs.proc_pid_rusage(pid, RUSAGE_INFO_V4, self._rusage) != 0:
                err = ctypes.get_errno()
                if err not in (errno.ESRCH, errno.EPERM, 0):
                    warn_once(f"rusage:{err}", f"proc_pid_rusage failed: {os.strerror(err)}")
                return None
            value = struct.unpack_from("=Q", self._rusage, RUSAGE_PHYS_FOOTPRINT_OFFSET)[0]
        return value or None

    def exact_footprint(self, pid: int) -> int | None:
        """On macOS the footprint is already the kernel's exact ledger."""
        return self.footprint(pid)
