"""The shared-memory ledger (docs/architecture.md, "The wire")."""

import msgspec
import multiprocess as mp
import pytest

from shared.ledger import LAYOUT_VERSION, Ledger, LedgerError
from shared.limits import Limits
from shared.memory import MemoryReading


def test_sample_round_trip_and_empty_slots(tmp_path):
    led = Ledger.create(tmp_path / "ledger", 4)
    assert led.read_sample(0) is None
    reading = MemoryReading(usage=27, footprint=30, mlx_active=10, mlx_pool=3, mlx_peak=20,
                            cache_bytes=11, cache_releasable=7, batch_bytes=13, batch_live_bytes=5,
                            batch_relayouts=4, pool_returns=2, pool_returned=6)
    led.write_sample(2, pid=42, t=1.5, memory=reading, running=1, queued=2, tokens=9, phase="busy")
    s = led.read_sample(2)
    assert s.memory == reading  # the worker's reading comes back whole, cache bytes too (H2/H3)
    assert (s.pid, s.running, s.queued, s.tokens, s.phase) == (42, 1, 2, 9, "busy")
    other = Ledger.attach(tmp_path / "ledger")
    assert other.read_sample(2) == s
    led.clear_slot(2)
    assert other.read_sample(2) is None
    other.close()
    led.close()


def test_limits_round_trip(tmp_path):
    led = Ledger.create(tmp_path / "ledger", 2)
    limits = Limits(soft_limit=1, hard_limit=2, hard_watermark=3, abort_limit=4, abort_margin=0.93,
                    prefill_headroom_safety=0.92, ceiling=5, static=6, dynamic=5, gpu_cap=0,
                    binding="dynamic", tier="aggressive", admission_paused=True, max_concurrency=3,
                    cache_cap=7, pool_max=8, residency=9, device_soft=10, device_hard=11)
    led.write_limits(1, limits)
    assert Ledger.attach(tmp_path / "ledger").read_limits(1) == limits
    assert led.read_limits(0) is None


def test_u2_group_usage_sums_supervisor_and_live_slots(tmp_path):
    led = Ledger.create(tmp_path / "ledger", 3)
    led.write_supervisor(100, 0.0)
    for slot, usage in ((0, 1000), (2, 20)):
        led.write_sample(slot, pid=1 + slot, t=0.0, memory=MemoryReading(footprint=usage, usage=usage))
    assert led.group_usage() == 1120


def test_attach_refuses_foreign_or_short_files(tmp_path):
    (tmp_path / "junk").write_bytes(b"x" * 200)
    with pytest.raises(LedgerError, match=f"not a v{LAYOUT_VERSION} memvisor ledger"):
        Ledger.attach(tmp_path / "junk")
    (tmp_path / "short").write_bytes(b"x")
    with pytest.raises(LedgerError, match="too short"):
        Ledger.attach(tmp_path / "short")
    with pytest.raises(LedgerError, match="outside"):
        Ledger.create(tmp_path / "ok", 2).read_sample(5)


def _hammer(path, n):
    led = Ledger.attach(path)
    for i in range(1, n + 1):
        memory = MemoryReading(usage=i, footprint=i, mlx_active=i, mlx_pool=i, mlx_peak=i, cache_bytes=i,
                               cache_releasable=i, batch_bytes=i, batch_live_bytes=i, batch_relayouts=i,
                               pool_returns=i, pool_returned=i)
        led.write_sample(0, pid=i, t=float(i), memory=memory, running=i, queued=i, tokens=i)


def test_reader_never_sees_a_torn_sample_while_another_process_writes(tmp_path):
    """Every field of each write carries the same number; a torn read would mix two."""
    led = Ledger.create(tmp_path / "ledger", 1)
    proc = mp.get_context("spawn").Process(target=_hammer, args=(tmp_path / "ledger", 200_000))
    proc.start()
    seen = 0
    last = 0
    while proc.is_alive() or seen == 0:
        s = led.read_sample(0)
        if s is None:
            continue
        fields = {s.pid, *msgspec.structs.astuple(s.memory), s.running, s.queued, s.tokens, int(s.t)}
        assert len(fields) == 1, s
        assert s.pid >= last  # values only move forward
        last = s.pid
        seen += 1
    proc.join()
    assert proc.exitcode == 0
    assert seen > 100
