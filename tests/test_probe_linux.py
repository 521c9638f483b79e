"""Linux probes (SPEC C inputs, C2 fallbacks, T3, U1) on captured and broken files,
and live against this machine's /proc read independently here.

Fixture roots are described in tests/fixtures/probe/README.md. Expected values
are read from the fixture files with the plain `split()` parsers below, not
with the probe's own parser.
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

from shared import probe as facade
from shared.probe import ProbeError
from shared.probe.cgroups import _swap_allowed, locate_cgroup, parse_mountinfo, parse_proc_cgroup
from shared.probe.linux import LinuxProbe, host_counters
from shared.probe.procfs import (
    UNLIMITED,
    Meminfo,
    ProcFile,
    parse_cgroup_stat,
    parse_limit,
    parse_meminfo,
    parse_psi,
    parse_smaps_rollup,
    parse_statm,
)

FIXTURES = Path(__file__).parent / "fixtures" / "probe"
V1_HOST = FIXTURES / "linux_v1_host"
V1_LIMITED = FIXTURES / "linux_v1_limited"
V2_CONTAINER = FIXTURES / "linux_v2_container"
V2_SYSTEMD = FIXTURES / "linux_v2_systemd"
GiB = 1024**3
PAGE = os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux probes")


def kb_fields(path: Path) -> dict[str, int]:
    """`Key: N kB` lines -> bytes (the test's own, independent reader)."""
    out = {}
    for line in path.read_text().splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0]] = int(parts[1]) * 1024
    return out


def kv_fields(path: Path) -> dict[str, int]:
    """`key N` lines (memory.stat) -> ints."""
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def one_int(path: Path) -> int:
    return int(path.read_text())


def copy_root(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees its own first warning (the set is process-wide)."""
    facade._warned.clear()
    yield
    facade._warned.clear()


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


# ---------------------------------------------------------------------------
# Where the cgroup is, and which limit binds


def test_c_cgroup_v1_hybrid_layout_is_located():
    place = locate_cgroup(str(V1_HOST))
    cg = (V1_HOST / "proc/self/cgroup").read_text()
    own = next(l.split(":", 2)[2] for l in cg.splitlines() if ":memory:" in l)
    assert place is not None and place.version == 1
    assert place.dirs[0] == str(V1_HOST / "sys/fs/cgroup/memory") + own
    assert place.dirs[-1] == str(V1_HOST / "sys/fs/cgroup/memory")
    assert len(place.dirs) == own.count("/") + 1


def test_c_unlimited_v1_cgroup_leaves_physical_total():
    """The kernel's v1 "unlimited" (PAGE_COUNTER_MAX pages) is not a limit."""
    sentinel = one_int(next((V1_HOST / "sys/fs/cgroup/memory").glob("process_api/*/memory.limit_in_bytes")))
    assert sentinel >= UNLIMITED
    reading = LinuxProbe(root=str(V1_HOST)).reading()
    assert reading.container_limit is None
    assert reading.total_source == "physical"
    assert reading.counters.total == reading.physical_total
    assert reading.cgroup is not None and reading.cgroup.startswith("v1 ")


def test_c_v1_limit_on_an_ancestor_binds_and_counters_describe_it():
    """A limit set on a parent cgroup holds the whole subtree: total and the
    counters must come from that parent, not from the process's own cgroup."""
    parent = V1_LIMITED / "sys/fs/cgroup/memory/process_api"
    limit, usage = one_int(parent / "memory.limit_in_bytes"), one_int(parent / "memory.usage_in_bytes")
    stat = kv_fields(parent / "memory.stat")
    host = kb_fields(V1_LIMITED / "proc/meminfo")
    reading = LinuxProbe(root=str(V1_LIMITED)).reading()
    c = reading.counters
    assert (reading.total_source, c.total, reading.container_limit) == ("container", limit, limit)
    assert reading.container_usage == usage
    assert c.free == min(limit - usage, host["MemFree"])
    assert c.inactive == stat["total_inactive_file"]
    assert c.file_backed == stat["total_active_file"] + stat["total_inactive_file"]
    assert c.active == stat["total_active_anon"] + stat["total_active_file"]
    assert reading.cgroup == f"v1 {parent}"
    assert "memory.stat total_inactive_file" in reading.sources["inactive"]


def test_c_v2_container_with_namespace_binds_memory_max():
    cg = V2_CONTAINER / "sys/fs/cgroup"
    limit, usage = one_int(cg / "memory.max"), one_int(cg / "memory.current")
    stat = kv_fields(cg / "memory.stat")
    reading = LinuxProbe(root=str(V2_CONTAINER)).reading()
    c = reading.counters
    assert (reading.total_source, c.total) == ("container", limit)
    assert c.free == limit - usage
    assert c.inactive == stat["inactive_file"]
    assert c.file_backed == stat["active_file"] + stat["inactive_file"]
    assert c.active == stat["active_anon"] + stat["active_file"]
    assert reading.sources["container_limit"] == str(cg / "memory.max")


def test_c_smallest_limit_on_the_path_binds_including_memory_high():
    """memory.high throttles the whole slice long before memory.max kills:
    a guard that aimed at max would sit in reclaim stalls."""
    slice_dir = V2_SYSTEMD / "sys/fs/cgroup/user.slice/user-1000.slice"
    high = one_int(slice_dir / "memory.high")
    assert high < one_int(slice_dir / "memory.max")
    reading = LinuxProbe(root=str(V2_SYSTEMD)).reading()
    assert reading.counters.total == reading.container_limit == high
    assert reading.container_usage == one_int(slice_dir / "memory.current")
    assert reading.cgroup == f"v2 {slice_dir}"
    assert reading.counters.free == high - one_int(slice_dir / "memory.current")


def test_c_budget_below_the_container_limit_binds_but_counters_stay_the_containers():
    cg = V2_CONTAINER / "sys/fs/cgroup"
    reading = LinuxProbe(root=str(V2_CONTAINER)).reading(budget=2 * GiB)
    assert (reading.total_source, reading.counters.total) == ("budget", 2 * GiB)
    assert reading.counters.free == one_int(cg / "memory.max") - one_int(cg / "memory.current")


def test_c_container_free_never_exceeds_host_free(tmp_path):
    """A container limit is a promise the host may not keep: when the host is
    short, the host's free memory is what there is."""
    root = copy_root(V2_CONTAINER, tmp_path)
    meminfo = root / "proc/meminfo"
    text = "".join(
        "MemFree:          102400 kB\n" if l.startswith("MemFree:") else l
        for l in meminfo.read_text().splitlines(keepends=True)
    )
    meminfo.write_text(text)
    assert LinuxProbe(root=str(root)).counters().free == 102400 * 1024


def test_t3_container_forbidden_to_swap_cannot_compress():
    """Host swap (here zram) is of no use to a cgroup with memory.swap.max 0."""
    reading = LinuxProbe(root=str(V2_CONTAINER)).reading()
    assert reading.swap_total and reading.swap_total > 0
    assert reading.zram is True and reading.zswap is True
    assert reading.counters.compressor is False


def test_t3_container_allowed_to_swap_can_compress():
    assert LinuxProbe(root=str(V2_SYSTEMD)).counters().compressor is True


def test_t3_v1_memsw_limit_equal_to_memory_limit_forbids_swap(tmp_path):
    (tmp_path / "memory.memsw.limit_in_bytes").write_bytes(b"8589934592\n")
    assert _swap_allowed(1, str(tmp_path), 8 * GiB) is False
    (tmp_path / "memory.memsw.limit_in_bytes").write_bytes(b"12884901888\n")
    assert _swap_allowed(1, str(tmp_path), 8 * GiB) is True
    (tmp_path / "memory.memsw.limit_in_bytes").unlink()
    assert _swap_allowed(1, str(tmp_path), 8 * GiB) is None


@pytest.mark.parametrize(
    ("data", "want"),
    [(b"max\n", None), (b"9223372036854771712\n", None), (b"4294967296\n", 4294967296),
     (b"18446744073709551615\n", None), (b"0\n", 0)],
)
def test_c_limit_files_max_and_sentinels(data, want):
    assert parse_limit(data) == want


@pytest.mark.parametrize("data", [b"lots\n", b"-1\n", b"4294967", b"", b"4 GiB\n"])
def test_c_garbage_or_truncated_limit_is_an_error_naming_the_file(data):
    with pytest.raises(ProbeError, match="memory.max"):
        parse_limit(data, "/sys/fs/cgroup/memory.max")


def test_c_garbage_limit_keeps_host_counters_with_one_warning(tmp_path, caplog):
    root = copy_root(V2_CONTAINER, tmp_path)
    (root / "sys/fs/cgroup/memory.max").write_bytes(b"lots\n")
    probe = LinuxProbe(root=str(root))
    with caplog.at_level(logging.WARNING, logger="memvisor.probe"):
        readings = [probe.reading() for _ in range(3)]
    assert all(r.total_source == "physical" for r in readings)
    assert readings[0].counters.free == kb_fields(root / "proc/meminfo")["MemFree"]
    assert all(any("container limit unknown" in w for w in r.warnings) for r in readings)
    assert len([r for r in caplog.records if "container limit unknown" in r.message]) == 1


def test_c_unreadable_container_usage_falls_back_to_host_counters(tmp_path):
    root = copy_root(V2_CONTAINER, tmp_path)
    (root / "sys/fs/cgroup/memory.current").write_bytes(b"garbage\n")
    reading = LinuxProbe(root=str(root)).reading()
    assert reading.counters.total == 4 * GiB  # the limit still binds the total
    assert reading.counters.free == kb_fields(root / "proc/meminfo")["MemFree"]
    assert any("memory.current" in w for w in reading.warnings)


def test_c2_container_stat_missing_fields_gives_available_only(tmp_path):
    root = copy_root(V2_CONTAINER, tmp_path)
    stat = root / "sys/fs/cgroup/memory.stat"
    stat.write_text(_without_lines(stat.read_text(), "active_file", "inactive_file"))
    counters = LinuxProbe(root=str(root)).counters()
    cg = root / "sys/fs/cgroup"
    assert counters.free is None
    assert counters.available == one_int(cg / "memory.max") - one_int(cg / "memory.current")


def test_c_new_limit_is_seen_on_the_slow_cadence_not_every_tick(tmp_path):
    """`docker update --memory` changes the limit of a running container: it
    must be seen within slow_interval, without rediscovering every tick."""
    root = copy_root(V2_CONTAINER, tmp_path)
    now = [100.0]
    probe = LinuxProbe(root=str(root), slow_interval=5.0, clock=lambda: now[0])
    assert probe.counters().total == 4 * GiB
    (root / "sys/fs/cgroup/memory.max").write_bytes(b"2147483648\n")
    now[0] += 4.9
    assert probe.counters().total == 4 * GiB
    now[0] += 0.2
    assert probe.counters().total == 2 * GiB


def test_c_v1_cgroup_stat_prefers_hierarchical_totals():
    data = b"inactive_file 1\ntotal_inactive_file 10\nactive_file 2\nhierarchical_memory_limit 77\n"
    stat = parse_cgroup_stat(data, 1)
    assert stat.inactive_file == 10  # total_* includes the children
    assert stat.active_file == 2     # no total_ key: the plain one
    assert stat.hierarchical_limit == 77


def test_c_proc_self_cgroup_v1_combined_controllers_and_v2():
    member = parse_proc_cgroup(b"5:cpu,memory:/docker/abc\n0::/system.slice/x.service\n")
    assert member.v1_memory == "/docker/abc"
    assert member.v2 == "/system.slice/x.service"
    assert parse_proc_cgroup(b"garbage\n\n").v1_memory is None


def test_c_mountinfo_escaped_mountpoint_and_foreign_mounts():
    data = (
        b"31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        b"41 31 0:38 /docker/abc /my\\040cgroups rw,relatime - cgroup2 cgroup2 rw\n"
        b"broken line\n"
    )
    (mount,) = parse_mountinfo(data)
    assert (mount.root, mount.mountpoint, mount.fstype) == ("/docker/abc", "/my cgroups", "cgroup2")


def test_c_cgroup_path_outside_the_mount_means_the_mount_is_ours(tmp_path):
    """Without a cgroup namespace but with the container's cgroup mounted as
    its root, /proc/self/cgroup names a path the mount does not show."""
    root = copy_root(V2_CONTAINER, tmp_path)
    (root / "proc/self/cgroup").write_bytes(b"0::/system.slice/docker-abc.scope\n")
    place = locate_cgroup(str(root))
    assert place is not None and place.dirs == (str(root / "sys/fs/cgroup"),)


def test_c_no_memory_cgroup_at_all(tmp_path):
    root = copy_root(V1_HOST, tmp_path)
    (root / "proc/self/cgroup").write_bytes(b"1:name=systemd:/\n")
    reading = LinuxProbe(root=str(root)).reading()
    assert reading.cgroup is None and reading.total_source == "physical"
    assert reading.counters.free is not None


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
