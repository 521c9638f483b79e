"""Linux probes (SPEC C inputs, T3) on captured and broken cgroup trees: where the cgroup is,
which limit binds (v1, v2, an ancestor's, memory.high, a budget), whether the container may
swap, and what a broken limit file leaves.

Fixture roots are described in tests/fixtures/probe/README.md; expected values
are read with the plain parsers of tests/probe_linux_harness.py.
"""

from __future__ import annotations

import logging

import pytest

from shared.probe import ProbeError
from shared.probe.cgroups import _swap_allowed, locate_cgroup, parse_mountinfo, parse_proc_cgroup
from shared.probe.linux import LinuxProbe
from shared.probe.procfs import UNLIMITED, parse_cgroup_stat, parse_limit
from tests.probe_linux_harness import (
    V1_HOST,
    V1_LIMITED,
    V2_CONTAINER,
    V2_SYSTEMD,
    GiB,
    copy_root,
    fresh_warnings,  # noqa: F401  (autouse: each test's own first warning)
    kb_fields,
    kv_fields,
    linux_only,
    one_int,
)

pytestmark = linux_only


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
