"""Linux probes (SPEC C2 and its fallbacks, T3, U1) on captured and broken files,
and live against this machine's /proc read independently here; the cgroups and
the limit that binds are tests/test_probe_cgroups.py.

Fixture roots are described in tests/fixtures/probe/README.md. Expected values
are read from the fixture files with the plain `split()` parsers of
tests/probe_linux_harness.py, not with the probe's own parser.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.probe import ProbeError
from shared.probe.linux import LinuxProbe, host_counters
from shared.probe.procfs import (
    Meminfo,
    ProcFile,
    parse_meminfo,
    parse_psi,
    parse_smaps_rollup,
    parse_statm,
)
from tests.probe_linux_harness import (
    V1_HOST,
    V2_CONTAINER,
    GiB,
    copy_root,
    fresh_warnings,  # noqa: F401  (autouse: each test's own first warning)
    kb_fields,
    linux_only,
    one_int,
)

PAGE = os.sysconf("SC_PAGE_SIZE")

pytestmark = linux_only


# ---------------------------------------------------------------------------
# /proc/meminfo and the C2 mapping


def test_c2_meminfo_captured_file_parses_every_field():
    data = (V1_HOST / "proc/meminfo").read_bytes()
    want = kb_fields(V1_HOST / "proc/meminfo")
    mi = parse_meminfo(data)
    assert mi.total == want["MemTotal"]
    assert mi.free == want["MemFree"]
    assert mi.available == want["MemAvailable"]
    assert mi.active_anon == want["Active(anon)"]
    assert mi.inactive_anon == want["Inactive(anon)"]
    assert mi.active_file == want["Active(file)"]
    assert mi.inactive_file == want["Inactive(file)"]
    assert mi.shmem == want["Shmem"]
    assert mi.swap_total == want["SwapTotal"] == 0


def test_c2_linux_counts_only_file_pages_as_inactive():
    """Without swap an inactive ANONYMOUS page cannot be reclaimed: counting
    the whole Inactive list (as macOS may) would promise memory that does not
    exist -- the over-optimistic ceiling that let the seed's machines run out."""
    want = kb_fields(V1_HOST / "proc/meminfo")
    counters = LinuxProbe(root=str(V1_HOST)).counters()
    assert counters.free == want["MemFree"]
    assert counters.inactive == want["Inactive(file)"]
    assert counters.inactive != want["Inactive"]
    assert counters.file_backed == want["Active(file)"] + want["Inactive(file)"]
    # so that C2's active - file_active is exactly the anonymous active list
    assert counters.active - (counters.file_backed - counters.inactive) == want["Active(anon)"]
    assert counters.available == want["MemAvailable"]
    assert counters.total == want["MemTotal"]


def test_t3_no_swap_means_no_compressor():
    assert LinuxProbe(root=str(V1_HOST)).counters().compressor is False


def test_t3_swap_on_the_host_means_compressor():
    mi = Meminfo(free=1, active_anon=1, active_file=1, inactive_file=1, swap_total=8 * GiB)
    assert host_counters(mi, 16 * GiB)[0].compressor is True


def _without_lines(text: str, *prefixes: str) -> str:
    return "".join(l for l in text.splitlines(keepends=True) if not l.startswith(prefixes))


def test_c2_missing_page_counters_fall_back_to_available_with_one_warning(tmp_path, caplog):
    root = copy_root(V1_HOST, tmp_path)
    meminfo = root / "proc/meminfo"
    meminfo.write_text(_without_lines(meminfo.read_text(), "Inactive(file)"))
    probe = LinuxProbe(root=str(root))
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        readings = [probe.counters() for _ in range(3)]
    assert all(c.free is None and c.inactive is None for c in readings)
    assert readings[0].available == kb_fields(meminfo)["MemAvailable"]
    assert len([r for r in caplog.records if "MemAvailable only" in r.message]) == 1


def test_c2_meminfo_with_nothing_usable_gives_no_reading(tmp_path):
    root = copy_root(V1_HOST, tmp_path)
    meminfo = root / "proc/meminfo"
    meminfo.write_text(_without_lines(meminfo.read_text(), "MemFree", "MemAvailable"))
    counters = LinuxProbe(root=str(root)).counters()
    assert counters.free is None and counters.available is None
    assert counters.total == kb_fields(meminfo)["MemTotal"]


def test_c2_unreadable_meminfo_gives_physical_total_only(tmp_path, caplog):
    root = copy_root(V1_HOST, tmp_path)
    (root / "proc/meminfo").unlink()
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        reading = LinuxProbe(root=str(root)).reading()
    assert reading.counters.free is None and reading.counters.available is None
    assert reading.physical_total == os.sysconf("SC_PHYS_PAGES") * PAGE
    assert reading.sources["physical_total"].startswith("sysconf")
    assert any("meminfo" in w for w in reading.warnings)


def test_c2_truncated_meminfo_does_not_yield_a_short_number():
    """A read cut mid-line ("MemFree:  2444") must not pass for 2444 kB free."""
    data = (V1_HOST / "proc/meminfo").read_bytes()
    cut = data.index(b"MemFree:") + len(b"MemFree:") + 12
    mi = parse_meminfo(data[:cut])
    assert mi.total == kb_fields(V1_HOST / "proc/meminfo")["MemTotal"]
    assert mi.free is None and mi.available is None


@pytest.mark.parametrize(
    "line",
    [b"MemFree:        lots kB\n", b"MemFree:        -5 kB\n", b"MemFree:        12 MB\n",
     b"MemFree:\n", b"MemFree:        1 2 kB\n"],
)
def test_c2_garbage_meminfo_values_are_absent_not_guessed(line):
    assert parse_meminfo(b"MemTotal:       1000 kB\n" + line).free is None


def test_c2_huge_meminfo_values_are_exact():
    mi = parse_meminfo(b"MemTotal: 18014398509481983 kB\nMemFree: 9007199254740993 kB\n")
    assert mi.total == 18014398509481983 * 1024
    assert mi.free == 9007199254740993 * 1024


def test_procfile_reads_a_file_larger_than_its_buffer(tmp_path):
    path = tmp_path / "big"
    payload = b"".join(b"Filler%05d:  1 kB\n" % i for i in range(1000)) + b"MemFree: 7 kB\n"
    path.write_bytes(payload)
    assert len(payload) > 16384
    f = ProcFile(str(path))
    assert f.read() == payload
    assert parse_meminfo(f.read()).free == 7 * 1024
    f.close()


def test_procfile_names_the_file_it_cannot_read(tmp_path):
    with pytest.raises(ProbeError, match="nope"):
        ProcFile(str(tmp_path / "nope")).read()


def test_c2_container_stat_missing_fields_gives_available_only(tmp_path):
    root = copy_root(V2_CONTAINER, tmp_path)
    stat = root / "sys/fs/cgroup/memory.stat"
    stat.write_text(_without_lines(stat.read_text(), "active_file", "inactive_file"))
    counters = LinuxProbe(root=str(root)).counters()
    cg = root / "sys/fs/cgroup"
    assert counters.free is None
    assert counters.available == one_int(cg / "memory.max") - one_int(cg / "memory.current")

# ---------------------------------------------------------------------------
# PSI


def test_c_psi_captured_file():
    psi = parse_psi((V1_HOST / "proc/pressure/memory").read_bytes(), "psi")
    assert psi.full is not None
    assert psi.some.total_us == int((V1_HOST / "proc/pressure/memory").read_text().split("total=")[1].split()[0])


def test_c_psi_of_the_binding_v2_cgroup_is_preferred():
    reading = LinuxProbe(root=str(V2_CONTAINER)).reading()
    assert reading.psi is not None
    assert reading.psi.source == str(V2_CONTAINER / "sys/fs/cgroup/memory.pressure")
    assert (reading.psi.some.avg10, reading.psi.full.total_us) == (1.25, 456789)


def test_c_psi_without_full_line_and_garbage():
    psi = parse_psi(b"some avg10=0.50 avg60=0.25 avg300=0.00 total=99\n")
    assert psi.full is None and psi.some.avg10 == 0.5
    for bad in (b"some avg10=x avg60=0 avg300=0 total=1\n", b"nothing\n", b"some avg10=1"):
        with pytest.raises(ProbeError):
            parse_psi(bad)


def test_c_garbage_psi_is_reported_not_raised(tmp_path):
    root = copy_root(V1_HOST, tmp_path)
    (root / "proc/pressure/memory").write_bytes(b"\x00\xff")
    reading = LinuxProbe(root=str(root)).reading()
    assert reading.psi is None and any("pressure" in w for w in reading.warnings)
    (root / "proc/pressure/memory").unlink()
    assert LinuxProbe(root=str(root)).reading().psi is None


# ---------------------------------------------------------------------------
# Footprints (U1)


def test_u1_footprint_is_anonymous_resident_not_rss():
    """RSS counts shared file pages (libraries, mapped weights) once per
    process: summed over workers it would count them many times over."""
    statm = (V1_HOST / "proc/4242/statm").read_text().split()
    smaps = kb_fields(V1_HOST / "proc/4242/smaps_rollup")
    got = LinuxProbe(root=str(V1_HOST)).footprint(4242)
    assert got == (int(statm[1]) - int(statm[2])) * PAGE
    assert got == smaps["Private_Dirty"]  # read back to back from one process
    assert got < smaps["Rss"]


def test_u1_exact_footprint_is_uss_from_smaps_rollup():
    smaps = kb_fields(V1_HOST / "proc/4242/smaps_rollup")
    want = smaps["Private_Clean"] + smaps["Private_Dirty"] + smaps["Private_Hugetlb"]
    assert LinuxProbe(root=str(V1_HOST)).exact_footprint(4242) == want
    assert parse_smaps_rollup(b"Rss: 5 kB\n") is None


def test_u1_footprint_of_a_missing_or_zombie_process_is_none(tmp_path):
    root = copy_root(V1_HOST, tmp_path)
    probe = LinuxProbe(root=str(root))
    assert probe.footprint(999999) is None
    assert probe.exact_footprint(999999) is None
    (root / "proc/4242/statm").write_bytes(b"0 0 0 0 0 0 0\n")  # a zombie's statm
    assert probe.footprint(4242) is None
    assert parse_statm(b"1 2", PAGE) is None  # truncated


def test_u1_footprint_descriptor_cache_is_bounded(tmp_path, monkeypatch):
    import shared.probe.linux as pl

    monkeypatch.setattr(pl, "_MAX_FDS", 3)
    root = copy_root(V1_HOST, tmp_path)
    for pid in range(5000, 5006):
        shutil.copytree(root / "proc/4242", root / f"proc/{pid}")
    probe = LinuxProbe(root=str(root))
    for pid in range(5000, 5006):
        assert probe.footprint(pid) is not None
    assert len(probe._statm) == 3


# ---------------------------------------------------------------------------
# Live, against this machine's /proc read independently


def test_c2_live_counters_match_proc_meminfo():
    probe = LinuxProbe()
    counters = probe.counters()
    want = kb_fields(Path("/proc/meminfo"))
    slack = 256 * 1024 * 1024  # other processes run between the two reads
    assert counters.total <= want["MemTotal"]
    assert abs(counters.inactive - want["Inactive(file)"]) < slack
    assert abs(counters.file_backed - want["Active(file)"] - want["Inactive(file)"]) < slack
    assert abs(counters.active - want["Active(anon)"] - want["Active(file)"]) < slack
    assert counters.compressor == (want["SwapTotal"] > 0)
    reading = probe.reading()
    assert reading.physical_total == want["MemTotal"]
    assert abs(reading.counters.free - want["MemFree"]) < slack
    limit = reading.container_limit
    assert reading.counters.total == min(want["MemTotal"], limit or want["MemTotal"])


def test_u1_live_footprint_follows_allocations_and_matches_status():
    probe = LinuxProbe()
    pid = os.getpid()
    before = probe.footprint(pid)
    # A fresh anonymous mapping with every page written: a bytearray could reuse
    # pages an earlier test freed but the allocator kept resident.
    block = mmap.mmap(-1, 64 * 1024 * 1024, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = probe.footprint(pid)
    status = dict(l.split(":", 1) for l in Path(f"/proc/{pid}/status").read_text().splitlines())
    rss_anon = int(status["RssAnon"].split()[0]) * 1024
    assert before is not None and after is not None
    assert after - before >= 60 * 1024 * 1024
    assert abs(after - rss_anon) < 8 * 1024 * 1024
    exact = probe.exact_footprint(pid)
    smaps = kb_fields(Path(f"/proc/{pid}/smaps_rollup"))
    assert exact is not None
    assert abs(exact - smaps["Private_Clean"] - smaps["Private_Dirty"]) < 8 * 1024 * 1024
    block.close()


def test_u1_live_footprint_of_an_exited_child_is_none():
    probe = LinuxProbe()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert (probe.footprint(child.pid) or 0) > 0
    finally:
        child.communicate(b"")
    assert probe.footprint(child.pid) is None
    assert child.pid not in probe._statm


def test_u1_forked_child_does_not_read_through_parent_descriptors():
    """After fork a cached /proc/<pid> descriptor still describes the parent."""
    probe = LinuxProbe()
    probe.footprint(os.getpid())
    assert probe._statm
    pid = os.fork()
    if pid == 0:  # child: report through the exit status only
        os._exit(0 if not probe._statm and probe._next_slow == float("-inf") else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert probe._statm  # the parent keeps its own
