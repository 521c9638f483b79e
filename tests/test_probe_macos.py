"""macOS probes (SPEC C inputs, C2, C4, U1) against recorded structures and
faked libSystem calls. No Mac runs here: the structures are packed byte by
byte from the XNU layouts cited in supervisor/probe_macos.py, and the fake
calls behave as osfmk/kern/host.c and the MIG user stub do (count handling,
revision boundaries, MIG_ARRAY_TOO_LARGE)."""

from __future__ import annotations

import ctypes
import errno
import logging
import struct

import pytest

from shared import probe as facade
from shared.probe import ProbeError
from shared.probe.macos import (
    HOST_VM_INFO64,
    MIG_ARRAY_TOO_LARGE,
    RUSAGE_INFO_V4,
    MacProbe,
    parse_vm_statistics64,
    sysctl_int,
    wired_limit_mb,
)

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


@pytest.fixture(autouse=True)
def fresh_warnings():
    facade._warned.clear()
    yield
    facade._warned.clear()


def test_c2_vm_statistics64_layout_is_byte_exact():
    """Every field at its XNU offset: a wrong one reads a neighbour's count."""
    sentinels = {name: i + 1 for i, (name, _) in enumerate(REV0_FIELDS + REV1_FIELDS)}
    raw = pack_vm(REV0_FIELDS + REV1_FIELDS, sentinels)
    assert len(raw) == 152 == 38 * 4
    assert raw[136:140] == struct.pack("=I", sentinels["external_page_count"])
    assert raw[92:96] == struct.pack("=I", sentinels["speculative_count"])
    vm = parse_vm_statistics64(raw, 38)
    assert (vm.free, vm.active, vm.inactive, vm.wired) == (1, 2, 3, 4)
    assert (vm.purgeable, vm.speculative) == (14, 15)
    assert (vm.compressor, vm.throttled, vm.external, vm.internal) == (20, 21, 22, 23)


def test_c2_revision0_only_has_no_file_backed_count():
    vm = parse_vm_statistics64(REV1[:96], 24)
    assert vm.free == RECORDED["free_count"] and vm.external is None
    with pytest.raises(ProbeError):
        parse_vm_statistics64(REV1[:80], 20)


def test_c2_macos_counters_from_recorded_structure():
    fake = FakeLibSystem(REV1)
    c = MacProbe(fake).counters()
    assert c.total == 32 * GiB
    # free_count already includes speculative pages: not added twice
    assert c.free == RECORDED["free_count"] * PAGE
    assert c.inactive == RECORDED["inactive_count"] * PAGE
    assert c.file_backed == RECORDED["external_page_count"] * PAGE
    assert c.active == RECORDED["active_count"] * PAGE
    assert c.compressor is True


def test_c2_page_size_is_the_kernels_not_the_process():
    """An x86_64 process under Rosetta sees 4 KiB pages, the counts are in
    16 KiB kernel pages: the wrong one would shrink every counter fourfold."""
    probe = MacProbe(FakeLibSystem(REV1))
    assert probe.counters().free == RECORDED["free_count"] * 16384


def test_c2_count_passed_is_revision1_never_the_buffer_capacity():
    """Newer kernels log "count is larger than expected ... likely to result
    in memory corruption" on every call whose count exceeds their own size:
    passing the 256-word buffer's capacity flooded the log once per tick."""
    fake = FakeLibSystem(REV2, kernel_words=40)
    probe = MacProbe(fake)
    probe.counters()
    probe.counters()
    assert fake.requests == [38, 38]


def test_c2_mig_array_too_large_retries_once_with_the_kernels_count():
    """macOS 27 betas began answering MIG_ARRAY_TOO_LARGE after a few calls;
    psutil and the seed then failed every reading until restarted."""
    fake = FakeLibSystem(REV2, kernel_words=40, mig_words=40)
    probe = MacProbe(fake)
    c = probe.counters()
    assert c.free == RECORDED["free_count"] * PAGE
    assert c.file_backed == RECORDED["external_page_count"] * PAGE
    probe.counters()
    assert fake.requests == [38, 40, 40]  # remembered: no failing call per tick


def test_c2_mig_count_beyond_the_buffer_falls_back_to_free_pages(caplog):
    fake = FakeLibSystem(REV1, mig_words=10_000,
                         sysctls={"vm.page_free_count": struct.pack("=i", 50_000)})
    probe = MacProbe(fake)
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        readings = [probe.counters() for _ in range(3)]
    assert fake.requests == [38, 38, 38]  # never asked for 10000 words
    assert all(c.free is None and c.available == 50_000 * PAGE for c in readings)
    assert len([r for r in caplog.records if "host_statistics64" in r.message]) == 1


def test_c2_failed_call_and_no_sysctl_gives_no_reading():
    fake = FakeLibSystem(REV1, mig_words=10_000)
    reading = MacProbe(fake).reading()
    assert reading.counters.free is None and reading.counters.available is None
    assert reading.counters.total == 32 * GiB
    assert reading.sources["available"] == "unavailable"
    assert reading.warnings


def test_c2_kernel_with_revision0_only_warns_and_omits_file_backed():
    fake = FakeLibSystem(REV1, kernel_words=24)
    reading = MacProbe(fake).reading()
    assert reading.counters.file_backed is None
    assert reading.counters.free == RECORDED["free_count"] * PAGE
    assert any("revision 0" in w for w in reading.warnings)


def test_c_total_is_hw_memsize_unless_a_budget_is_smaller():
    probe = MacProbe(FakeLibSystem(REV1))
    assert probe.reading().total_source == "physical"
    reading = probe.reading(budget=24 * GiB)
    assert (reading.counters.total, reading.total_source) == (24 * GiB, "budget")


def test_mach_host_self_is_called_once():
    """Each mach_host_self() call adds a send right to the port: per tick, a leak."""
    fake = FakeLibSystem(REV1)
    probe = MacProbe(fake)
    for _ in range(5):
        probe.counters()
    assert fake.host_ports == 1


def test_macos_reading_detail_and_sources():
    swapusage = struct.pack("=QQQIi", 2 * GiB, GiB, GiB, PAGE, 1)
    fake = FakeLibSystem(REV1, sysctls={
        "vm.swapusage": swapusage,
        "kern.memorystatus_vm_pressure_level": struct.pack("=i", 2),
    })
    reading = MacProbe(fake).reading()
    assert reading.platform == "darwin"
    assert reading.swap_total == 2 * GiB
    assert reading.detail["vm_wired"] == RECORDED["wire_count"] * PAGE
    assert reading.detail["vm_compressor"] == RECORDED["compressor_page_count"] * PAGE
    assert reading.detail["memorystatus_level"] == 2
    assert reading.sources["physical_total"] == "sysctl hw.memsize"
    assert "external_page_count" in reading.sources["file_backed"]


def test_u1_phys_footprint_from_rusage_info_v4():
    fake = FakeLibSystem(REV1)
    fake.rusage[321] = rusage_v4(phys_footprint=3 * GiB + 12345, lifetime_max=5 * GiB)
    raw = fake.rusage[321]
    assert len(raw) == 296 and raw[72:80] == struct.pack("=Q", 3 * GiB + 12345)
    probe = MacProbe(fake)
    assert probe.footprint(321) == 3 * GiB + 12345
    assert probe.exact_footprint(321) == 3 * GiB + 12345
    assert set(fake.rusage_flavors) == {RUSAGE_INFO_V4}


@pytest.mark.parametrize("err", [errno.ESRCH, errno.EPERM])
def test_u1_gone_or_foreign_process_has_no_footprint(err, caplog):
    fake = FakeLibSystem(REV1)
    fake.rusage_errno = err
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert MacProbe(fake).footprint(4242) is None
    assert not caplog.records


def test_c4_wired_limit_is_read_with_sysctlbyname():
    assert wired_limit_mb(FakeLibSystem(REV1, sysctls={
        "iogpu.wired_limit_mb": struct.pack("=i", 24576)})) == 24576
    assert wired_limit_mb(FakeLibSystem(REV1, sysctls={
        "iogpu.wired_limit_mb": struct.pack("=q", 20480)})) == 20480
    assert wired_limit_mb(FakeLibSystem(REV1, sysctls={
        "iogpu.wired_limit_mb": struct.pack("=i", 0)})) == 0


def test_c4_absent_wired_limit_is_zero_without_a_warning(caplog):
    """Intel Macs and older macOS have no iogpu sysctl: normal, not a fault."""
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert wired_limit_mb(FakeLibSystem(REV1)) == 0
    assert not caplog.records


def test_sysctl_of_unexpected_size_is_an_error():
    fake = FakeLibSystem(REV1, sysctls={"odd": b"\x01\x02"})
    with pytest.raises(ProbeError, match="odd"):
        sysctl_int(fake, "odd")
