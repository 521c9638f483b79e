"""Recorded macOS structures and a faked libSystem, for the macOS probe's tests (no tests here).

No Mac runs here: the structures are packed byte by byte from the XNU layouts cited in
shared/probe/macos.py, and the fake calls behave as osfmk/kern/host.c and the MIG user
stub do (count handling, revision boundaries, MIG_ARRAY_TOO_LARGE). The readings are a
32 GiB M-series Mac under load as its counters would read, not captured from one.
"""

from __future__ import annotations

import ctypes
import errno
import struct

from shared.probe.macos import HOST_VM_INFO64, MIG_ARRAY_TOO_LARGE

GiB = 1024**3
PAGE = 16384  # Apple silicon's kernel page

# struct vm_statistics64, osfmk/mach/vm_statistics.h, field by field.
REV0_FIELDS = [
    ("free_count", "I"), ("active_count", "I"), ("inactive_count", "I"), ("wire_count", "I"),
    ("zero_fill_count", "Q"), ("reactivations", "Q"), ("pageins", "Q"), ("pageouts", "Q"),
    ("faults", "Q"), ("cow_faults", "Q"), ("lookups", "Q"), ("hits", "Q"), ("purges", "Q"),
    ("purgeable_count", "I"), ("speculative_count", "I"),
]
REV1_FIELDS = [
    ("decompressions", "Q"), ("compressions", "Q"), ("swapins", "Q"), ("swapouts", "Q"),
    ("compressor_page_count", "I"), ("throttled_count", "I"), ("external_page_count", "I"),
    ("internal_page_count", "I"), ("total_uncompressed_pages_in_compressor", "Q"),
]
REV2_FIELDS = [("swapped_count", "Q")]

# A 32 GiB M-series Mac under load, in 16 KiB pages.
RECORDED = {
    "free_count": 61_440, "active_count": 760_000, "inactive_count": 740_000,
    "wire_count": 300_000, "purgeable_count": 12_000, "speculative_count": 9_000,
    "compressor_page_count": 80_000, "throttled_count": 0, "external_page_count": 900_000,
    "internal_page_count": 600_000, "swapped_count": 0,
}


def pack_vm(fields, values: dict[str, int]) -> bytes:
    """Byte-exact, native order, no padding (the C layout has none)."""
    return b"".join(struct.pack("=" + kind, values.get(name, 0)) for name, kind in fields)


def rusage_v4(phys_footprint: int, lifetime_max: int = 0) -> bytes:
    """struct rusage_info_v4, bsd/sys/resource.h: uuid[16] + 35 uint64."""
    fields = [0] * 35
    fields[7] = phys_footprint        # ri_phys_footprint, 8th uint64
    fields[29] = lifetime_max         # ri_lifetime_max_phys_footprint
    return struct.pack("=16s35Q", b"\x01" * 16, *fields)


class FakeLibSystem:
    """libSystem's five calls, with the kernel's and MIG's count semantics."""

    def __init__(self, vm: bytes, kernel_words: int = 38, mig_words: int | None = None,
                 sysctls: dict[str, bytes] | None = None):
        self.vm = vm
        self.kernel_words = kernel_words   # the kernel's HOST_VM_INFO64_COUNT
        self.mig_words = mig_words         # answer MIG_ARRAY_TOO_LARGE below this count
        self.sysctls = {"hw.memsize": struct.pack("=Q", 32 * GiB), **(sysctls or {})}
        self.rusage: dict[int, bytes] = {}
        self.rusage_errno = errno.ESRCH
        self.requests: list[int] = []
        self.rusage_flavors: list[int] = []
        self.host_ports = 0

    def mach_host_self(self) -> int:
        self.host_ports += 1
        return 0x907

    def host_page_size(self, host, out) -> int:
        out[0] = PAGE
        return 0

    def host_statistics64(self, host, flavor, buf, count) -> int:
        asked = count[0]
        self.requests.append(asked)
        assert host == 0x907 and flavor == HOST_VM_INFO64
        if asked < 24:
            return 5  # KERN_FAILURE
        if self.mig_words is not None and asked < self.mig_words:
            ctypes.memmove(buf, self.vm, asked * 4)   # MIG copies what fits ...
            count[0] = self.mig_words                 # ... and says what it had
            return MIG_ARRAY_TOO_LARGE
        for boundary in (self.kernel_words, 40, 38, 24):  # revision boundaries
            if boundary <= min(asked, self.kernel_words):
                break
        ctypes.memmove(buf, self.vm, min(boundary * 4, len(self.vm)))
        count[0] = boundary
        return 0

    def sysctlbyname(self, name, oldp, oldlenp, newp, newlen) -> int:
        value = self.sysctls.get(name.decode())
        if value is None:
            ctypes.set_errno(errno.ENOENT)
            return -1
        if oldlenp[0] < len(value):
            ctypes.set_errno(errno.ENOMEM)
            return -1
        ctypes.memmove(oldp, value, len(value))
        oldlenp[0] = len(value)
        return 0

    def proc_pid_rusage(self, pid, flavor, buf) -> int:
        self.rusage_flavors.append(flavor)
        if pid not in self.rusage:
            ctypes.set_errno(self.rusage_errno)
            return -1
        ctypes.memmove(buf, self.rusage[pid], len(self.rusage[pid]))
        return 0


REV1 = pack_vm(REV0_FIELDS + REV1_FIELDS, RECORDED)
REV2 = pack_vm(REV0_FIELDS + REV1_FIELDS + REV2_FIELDS, RECORDED)


def recorded_with(**pages: int) -> bytes:
    """The recorded revision-1 structure with some counts changed (e.g. `wire_count`)."""
    return pack_vm(REV0_FIELDS + REV1_FIELDS, {**RECORDED, **pages})
