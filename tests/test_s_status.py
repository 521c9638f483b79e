"""SPEC S1: the guard status built from a snapshot and its tick."""

from __future__ import annotations

import msgspec

from shared.host import HostCounters
from shared.memory import MemoryReading
from shared.sizes import GiB
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.status import GuardStatus, build_status

S1_FIELDS = {
    "enabled", "tier", "custom_ceiling", "ceiling", "static", "dynamic", "gpu_cap", "gpu_cap_raw",
    "reserve", "other_app_ratio", "hot_cache_reserved", "hot_cache_budget", "worker_ceiling", "worker_abort_limit",
    "soft_threshold", "hard_threshold", "soft_bytes", "hard_bytes", "usage", "pressure_level",
    "utilization", "poll_interval", "workers",
}
S1_WORKER_FIELDS = {"model", "pid", "state", "pinned", "last_access", "usage", "mlx_active",
                    "mlx_pool", "restarts"}


def _snap(**kw) -> Snapshot:
    worker = WorkerRecord(worker="w1", model="small", pid=42, state="busy", pinned=True,
                          last_access=990.0, running=1, memory=MemoryReading(usage=6 * GiB, footprint=6 * GiB, mlx_active=5 * GiB, mlx_pool=GiB),
                          restarts=2, concurrency=2)
    guard = GuardSettings(tier="custom", custom_ceiling=10 * GiB, hot_cache_max=GiB)
    kw.setdefault("guard", guard)
    return Snapshot(now=1000.0, host=HostCounters(total=64 * GiB), supervisor_footprint=GiB,
                    gpu_cap_raw=20 * GiB, workers=[worker], **kw)


def test_s1_status_holds_every_field():
    s = _snap()
    status = build_status(s, tick(s))
    data = msgspec.to_builtins(status)
    assert S1_FIELDS <= set(data)
    assert S1_WORKER_FIELDS <= set(data["workers"][0])
    assert status.usage == 7 * GiB and status.ceiling == 10 * GiB
    assert status.utilization == 0.7 and status.pressure_level == "ok"
    assert status.gpu_cap_raw == 20 * GiB and status.gpu_cap == 20 * GiB
    assert status.hot_cache_reserved == 0  # nothing cached yet: nothing reserved (C12, 2026-12-01)
    assert status.worker_ceiling == 10 * GiB
    assert status.hot_cache_budget == GiB  # min(hot_cache_max, soft 9 GiB // 4) (H2)
    assert status.binding == "dynamic" and "raise the custom ceiling" in status.remedy
    (ws,) = status.workers
    assert (ws.model, ws.pid, ws.state, ws.pinned, ws.restarts) == ("small", 42, "busy", True, 2)
    assert ws.idle_seconds == 10.0 and ws.mlx_pool == GiB
    assert msgspec.json.decode(msgspec.json.encode(status), type=GuardStatus) == status


def test_s1_guard_off_has_zero_utilization_and_no_binding():
    s = _snap(guard=GuardSettings(enabled=False))
    status = build_status(s, tick(s))
    assert not status.enabled and status.ceiling == 0 and status.utilization == 0.0
    assert status.binding == "" and status.remedy == ""


def test_s1_c1_status_says_the_tier_reserves_more_than_the_machine():
    s = Snapshot(now=0.0, guard=GuardSettings(tier="safe"), host=HostCounters(total=4 * GiB, free=GiB))
    status = build_status(s, tick(s))
    assert status.reserve_exceeds_total and "reserves 6 GiB" in status.warning
