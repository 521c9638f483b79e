"""macOS probes (SPEC C inputs, C2, C4, U1, M3) against recorded structures and
faked libSystem calls (tests/macos_harness.py). No Mac runs here: the structures
are packed byte by byte from the XNU layouts cited in shared/probe/macos.py."""

from __future__ import annotations

import errno
import logging
import struct

import pytest

from shared import probe as facade
from shared.probe import ProbeError
from shared.probe.macos import RUSAGE_INFO_V4, MacProbe, parse_vm_statistics64, sysctl_int, wired_limit_mb
from tests.macos_harness import (
    PAGE,
    RECORDED,
    REV0_FIELDS,
    REV1,
    REV1_FIELDS,
    REV2,
    FakeLibSystem,
    GiB,
    pack_vm,
    recorded_with,
    rusage_v4,
)


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


def test_m3_wired_count_is_wire_count_pages_of_the_kernels_size():
    """M3 re-reads the OS's wired memory after every worker exit: host_statistics64's
    wire_count (vm_stat's "Pages wired down") x the kernel's 16 KiB page."""
    fake = FakeLibSystem(REV1)
    probe = MacProbe(fake)
    assert probe.wired_bytes() == RECORDED["wire_count"] * PAGE == 300_000 * 16384
    fake.vm = recorded_with(wire_count=310_000)  # a later reading: 156 MiB more wired
    assert probe.wired_bytes() == 310_000 * PAGE


def test_m3_a_failed_wired_reading_is_none_with_one_warning(caplog):
    probe = MacProbe(FakeLibSystem(REV1, mig_words=10_000))
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        assert [probe.wired_bytes() for _ in range(3)] == [None] * 3
    assert len([r for r in caplog.records if "stranded" in r.message]) == 1


def test_m3_no_wired_count_off_macos():
    """Only macOS strands wired memory: elsewhere the guard has nothing to watch (and no call is made)."""
    assert facade.read_wired() is None
