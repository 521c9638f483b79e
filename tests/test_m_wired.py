"""Wired memory on macOS (SPEC M2, M3, revised 2026-12-05): the pure decisions, the ceilings they
move and what status says. No Mac runs here: the OS's wired counts are the recorded vm_statistics64
structure (tests/macos_harness.py) with its `wire_count` changed, read by the probe's own parsing."""

from __future__ import annotations

import pytest

from shared.host import HostCounters
from shared.memory import MemoryReading
from shared.probe.macos import HOST_VM_INFO64_REV1_COUNT, parse_vm_statistics64, wired_bytes
from shared.sizes import GiB, MiB
from supervisor.cli.status import render
from supervisor.policy.ceilings import compute_ceilings
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.status import ServerStatus, build_status
from supervisor.policy.wired import (
    STRANDED_NOISE,
    WiredBefore,
    sigkill_after,
    still_stranded,
    stranded_after_exit,
    wiring_line,
)
from tests.macos_harness import PAGE, RECORDED, recorded_with

BASE = RECORDED["wire_count"]  # pages wired by the kernel and other apps in the recorded reading
HELD = 3 * GiB // PAGE         # pages the exiting worker held (its MLX active + pool on Metal)


def wired(pages: int) -> int:
    """The OS's wired bytes as the probe reads them from a structure holding `pages` wired pages."""
    return wired_bytes(parse_vm_statistics64(recorded_with(wire_count=pages), HOST_VM_INFO64_REV1_COUNT), PAGE)


def before(held_pages: int = HELD, others: int = 0) -> WiredBefore:
    """The last reading before the exit: the exiting worker and `others` bytes of other workers' GPU share."""
    held = held_pages * PAGE
    return WiredBefore(worker="big#1", model="big", held=held, wired=wired(BASE + held_pages) + others,
                       ours=held + others)


@pytest.mark.parametrize(("why", "wired_now", "ours_now", "stranded"), [
    ("it all came back", wired(BASE), 0, 0),
    ("none came back", wired(BASE + HELD), 0, HELD * PAGE),
    ("a third stayed wired", wired(BASE + HELD // 3), 0, HELD // 3 * PAGE),
    ("another worker loaded 5 GiB meanwhile: ours, not stranded", wired(BASE) + 5 * GiB, 5 * GiB, 0),
    ("other apps wired 8 GiB more meanwhile: never more than the worker held", wired(BASE + HELD) + 8 * GiB, 0,
     HELD * PAGE),
    ("other apps unwired 2 GiB meanwhile", wired(BASE) - 2 * GiB, 0, 0),
    ("a few pages moved: noise", wired(BASE + 2048), 0, 0),
])
def test_m3_what_an_exit_left_wired_after_5_s(why, wired_now, ours_now, stranded):
    assert stranded_after_exit(before(), wired_now, ours_now) == stranded, why


def test_m3_stranded_counts_only_from_the_noise_floor_and_only_what_the_worker_held():
    small = before(held_pages=STRANDED_NOISE // PAGE - 1)  # a worker holding less than the noise floor
    assert stranded_after_exit(small, wired(BASE + STRANDED_NOISE // PAGE), 0) == 0
    assert stranded_after_exit(before(), wired(BASE + STRANDED_NOISE // PAGE), 0) == STRANDED_NOISE


def test_m3_stranded_memory_counts_until_the_wired_count_says_it_came_back():
    stranded = 3 * GiB
    assert still_stranded(stranded, wired(BASE) + stranded, 0) == stranded  # other apps hold more than that
    assert still_stranded(stranded, 2 * GiB + 4 * GiB, 4 * GiB) == 2 * GiB  # only 2 GiB wired outside us now
    assert still_stranded(stranded, 4 * GiB, 4 * GiB) == 0


@pytest.mark.parametrize(("grace", "macos", "after"), [(10.0, True, 10.0), (30.0, True, 30.0), (3.0, True, 3.0),
                                                       (10.0, False, 5.0), (3.0, False, 3.0)])
def test_m3_sigkill_comes_only_after_the_whole_stop_grace_on_macos(grace, macos, after):
    assert sigkill_after(grace, macos) == after


def test_m3_stranded_memory_comes_off_static_and_the_gpu_cap_not_twice_off_dynamic():
    """Wired pages are not free, inactive or active: C2's dynamic already leaves them out. What
    plans without the host's counters (static, the GPU cap, residency, the abort limit) must not
    count them as the machine's."""
    host = HostCounters(total=64 * GiB, free=30 * GiB, inactive=4 * GiB, file_backed=2 * GiB, active=20 * GiB)
    kw = dict(tier="balanced", total=64 * GiB, host=host, own=10 * GiB, own_gpu=8 * GiB, gpu_cap_raw=48 * GiB)
    clean, lost = compute_ceilings(**kw), compute_ceilings(**kw, stranded=6 * GiB)
    assert lost.static == clean.static - 6 * GiB and lost.dynamic == clean.dynamic
    assert lost.gpu_cap == clean.gpu_cap - 6 * GiB and lost.gpu_cap_raw == 48 * GiB  # the kernel's cap, as read
    assert lost.residency_ceiling == min(lost.static, 42 * GiB)
    assert lost.abort_limit == min(lost.static, lost.gpu_cap)
    assert lost.wired_stranded == 6 * GiB and not lost.reserve_exceeds_total
    gone = compute_ceilings(**kw, stranded=100 * GiB)
    assert gone.static == 1 and gone.gpu_cap_raw == 48 * GiB  # never 0 ("no limit")


def _snap(**guard) -> Snapshot:
    worker = WorkerRecord(worker="w1", model="small", pid=42, state="ready", last_access=990.0,
                          memory=MemoryReading(usage=6 * GiB, footprint=6 * GiB, mlx_active=5 * GiB))
    return Snapshot(now=1000.0, host=HostCounters(total=64 * GiB), gpu_cap_raw=20 * GiB, workers=[worker],
                    guard=GuardSettings(**guard), wired_stranded=2 * GiB)


def _server(status) -> ServerStatus:
    return ServerStatus(pid=1, uptime=1.0, runtime_dir="/rt", pub="ipc://x", http="", guard=status, models=[],
                        events=[], malformed_frames=0, counters={})


def test_m2_status_says_wiring_is_on_with_the_sysctl_line_when_the_kernel_cap_is_low(monkeypatch):
    """The GPU cap (20 GiB) is below what the static ceiling would wire: the C13 line, in status's JSON
    and text. Stranded memory (M3) shows too, and has come off static."""
    monkeypatch.setattr("sys.platform", "darwin")  # status's words for the machine it runs on
    s = _snap(wire_weights=True)
    status = build_status(s, tick(s))
    assert status.wire_weights and "sudo sysctl iogpu.wired_limit_mb=" in status.wired_advice
    assert status.wired_stranded == 2 * GiB and status.static == 64 * GiB - status.reserve - 2 * GiB
    text = render(_server(status))
    assert "macOS wiring ON" in text and "mlx#3186" in text and "sudo sysctl iogpu.wired_limit_mb=" in text
    assert "wired memory stranded by worker exits: 2 GiB" in text


def test_m2_wiring_is_off_by_default_and_status_says_so_on_macos_only(monkeypatch):
    s = _snap()
    status = build_status(s, tick(s))
    assert not status.wire_weights and status.wired_advice == ""
    monkeypatch.setattr("sys.platform", "linux")
    assert "wiring" not in render(_server(status)).split("wired memory stranded")[0]
    monkeypatch.setattr("sys.platform", "darwin")
    assert "macOS wiring off (the default; [guard] wire_weights = true opts in)" in render(_server(status))


def test_m2_the_banner_words():
    assert wiring_line(False, False) == ""
    assert wiring_line(True, True).startswith("macOS wiring ON ([guard] wire_weights = true)")
    assert "no effect here" in wiring_line(True, False)
    assert "off" in wiring_line(False, True)


def test_m3_wired_helpers_read_the_recorded_page_counts():
    assert wired(BASE) == 300_000 * 16384 and wired(BASE + 1) - wired(BASE) == PAGE == 16 * 1024
    assert MiB < STRANDED_NOISE < GiB


def test_m2_serve_says_at_start_what_wire_weights_does_here(tmp_path):
    """The banner: `serve` logs the wiring line as it starts (off macOS: that the opt-in does nothing).
    The start is cut short by a taken PUB port, after the banner."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    config = tmp_path / "memvisor.toml"
    config.write_text(f'[guard]\nwire_weights = true\n[supervisor]\npub_tcp = "127.0.0.1:{taken.getsockname()[1]}"\n')
    try:
        out = subprocess.run([sys.executable, "-m", "supervisor", "serve", "--config", str(config), "--http", "off",
                              "--runtime-dir", str(tmp_path / "run")],
                             cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert out.returncode == 2, out.stderr
    assert wiring_line(True, sys.platform == "darwin") in out.stderr
