"""SPEC D4/D5 inside the tick and the load verdict: the device pool beside the host's.

The machine: 64 GiB of host RAM on the custom tier with a 10 GiB host ceiling
(plenty: each worker holds 1 GiB of it), and an 80 GiB device with
`custom_device_ceiling` 20 GiB (soft 0.8 -> 16 GiB, hard 0.9 -> 18 GiB).
"""

from __future__ import annotations

import msgspec

from shared.host import HostCounters
from shared.sizes import GiB
from supervisor.policy import decisions as d
from supervisor.policy.admission import admit
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from tests.records import record

GUARD = GuardSettings(tier="custom", custom_ceiling=10 * GiB, custom_device_ceiling=20 * GiB,
                      soft_threshold=0.8, hard_threshold=0.9)
HOST = HostCounters(total=64 * GiB)
DEVICE = 80 * GiB


def w(name: str, device_gib: float, **kw) -> WorkerRecord:
    kw.setdefault("model", f"m-{name}")
    held = int(device_gib * GiB)  # all of it MLX's (no NVML context on top)
    return record(worker=name, usage=GiB, footprint=GiB, device_bytes=held, mlx_active=held, **kw)


def busy(name: str, device_gib: float, **kw) -> WorkerRecord:
    return w(name, device_gib, state="busy", running=1, **kw)


def snap(*workers: WorkerRecord, others: float = 0, **kw) -> Snapshot:
    held = sum(x.device_bytes for x in workers)
    free = DEVICE - held - int(others * GiB)
    kw.setdefault("device_total", DEVICE)
    kw.setdefault("device_free", free)
    return Snapshot(now=100.0, guard=GUARD, host=HOST, workers=list(workers), **kw)


def kinds(result, kind):
    """The decisions of one kind, the tick's HandOutLimits spelt out as one decision a worker."""
    return [x for x in d.per_worker(result.decisions) if isinstance(x, kind)]


def test_d4_no_device_leaves_the_host_rules_alone():
    r = tick(snap(w("a", 0), w("b", 0), device_total=0, device_free=None))
    assert r.device is None and r.device_level == "ok" and r.level == "ok" and d.per_worker(r.decisions) == kinds(r, d.ApplyLimits)


def test_d4_group_level_is_the_device_level_when_the_device_is_worse():
    r = tick(snap(w("a", 9), w("b", 8)))  # device 17 GiB: soft band; host 2 GiB of 10: ok
    assert (r.host_level, r.device_level, r.level) == ("ok", "soft", "soft")
    [change] = kinds(r, d.LevelChanged)
    assert change.pool == "device" and change.usage == 17 * GiB and change.ceiling == 20 * GiB
    assert "device ceiling 20 GiB (device_static)" in change.reason
    assert kinds(r, d.PauseAdmission)  # P3 follows the group's level


def test_d4_p6_soft_on_the_device_stops_the_lru_idle_model_holding_device_bytes():
    r = tick(snap(w("old", 9, last_access=1), w("new", 8, last_access=2)))
    [stop] = kinds(r, d.Stop)
    assert stop.worker == "old" and "device memory pressure" in stop.reason
    assert "device usage 17 GiB > soft 16 GiB" in stop.reason


def test_d4_victims_are_chosen_by_the_bytes_they_hold_in_the_pool_under_pressure():
    """The least recently used idle model holds nothing on the device: stopping it frees nothing there."""
    r = tick(snap(w("cpu", 0, last_access=1), w("gpu", 9, last_access=2), busy("work", 9)))
    assert [x.worker for x in kinds(r, d.Stop)] == ["gpu"]


def test_d4_device_hard_without_idle_victims_aborts_the_lru_busy_model():
    r = tick(snap(busy("a", 10, last_access=1), busy("b", 9, last_access=2)))  # 19 GiB: hard
    assert r.device_level == "hard" and not r.device_emergency
    [abort] = kinds(r, d.AbortWorkerRequests)
    assert abort.worker == "a" and "device memory pressure" in abort.reason
    assert not kinds(r, d.MarkForUnload)


def test_d4_device_emergency_counts_in_the_state_and_marks_for_unload():
    s = snap(busy("a", 12, last_access=1), busy("b", 9, last_access=2))  # 21 GiB >= 20: over the ceiling
    first = tick(s)
    assert first.state.device_over_ceiling_ticks == 1 and not first.device_emergency
    second = tick(msgspec.structs.replace(s, state=first.state))
    assert second.state.device_over_ceiling_ticks == 2 and second.device_emergency and second.emergency
    assert [x.worker for x in kinds(second, d.MarkForUnload)] == ["a"]


def test_d4_device_emergency_at_once_two_gib_over_the_device_ceiling():
    r = tick(snap(busy("a", 22)))
    assert r.device_emergency and r.level == "hard"


def test_d4_host_pressure_is_still_the_host_pools():
    """Host hard (9.5 of 10 GiB) with a quiet device: the host rules act on host usage."""
    workers = [record(worker="a", model="m-a", usage=int(8.5 * GiB), footprint=int(8.5 * GiB), last_access=1),
               busy("b", 1)]
    r = tick(snap(*workers))
    assert (r.host_level, r.device_level) == ("hard", "ok")
    assert [x.worker for x in kinds(r, d.Stop)] == ["a"]
    [change] = kinds(r, d.LevelChanged)
    assert change.pool == "host"


def test_d4_device_binding_device_others_lowers_the_ceiling():
    r = tick(snap(w("a", 6), w("b", 5), others=70))  # free 80-11-70 = -1 -> ceiling floored
    assert r.device is not None and r.device.binding == "device_others"
    assert r.device_level == "hard"


def test_d5_load_counts_weights_against_the_device_pool_and_names_it_when_refused():
    v = admit(snap(busy("a", 15)), "big", 8 * GiB)  # 15 + 8 > 20 and nothing idle to stop
    assert not v.admitted and v.pool == "device" and v.error == "insufficient_memory"
    assert v.message.startswith("insufficient device memory")


def test_d5_load_evicts_idle_models_by_device_bytes():
    v = admit(snap(w("old", 9, last_access=1), w("new", 5, last_access=2)), "big", 6 * GiB)
    assert v.admitted and v.pool == "device" and v.evict == ["old"]


def test_d5_a_load_on_the_device_takes_nothing_from_host_ram():
    """10 GiB host ceiling, host 2 GiB used: a 12 GiB model is too large for the host, not for the device."""
    v = admit(snap(w("a", 1), w("b", 1)), "big", 12 * GiB)
    assert v.admitted and v.pool == "device" and v.evict == []


def test_d5_without_a_device_the_host_rules_answer():
    v = admit(snap(w("a", 0), device_total=0, device_free=None), "big", 12 * GiB)
    assert not v.admitted and v.pool == "host" and v.error == "model_too_large"


def test_d4_limits_carry_the_device_watermarks_so_workers_report_crossings_at_once():
    r = tick(snap(w("a", 1)))
    [limits] = {x.limits for x in kinds(r, d.ApplyLimits)}
    assert (limits.device_soft, limits.device_hard) == (16 * GiB, 18 * GiB)
    without = tick(snap(w("a", 0), device_total=0, device_free=None))
    assert {(x.limits.device_soft, x.limits.device_hard) for x in kinds(without, d.ApplyLimits)} == {(0, 0)}


def test_d4_device_watermarks_go_out_in_the_workers_own_measure():
    """NVML counts a CUDA context MLX cannot see: the watermarks a worker checks
    against its MLX bytes are lowered by that overhead, in 256 MiB steps."""
    a = record(worker="a", model="m-a", usage=GiB, device_bytes=3 * GiB, mlx_active=2 * GiB, mlx_pool=300 * 2**20)
    r = tick(snap(a))
    [limits] = {x.limits for x in kinds(r, d.ApplyLimits)}
    overhead = 512 * 2**20  # 3 GiB - 2.29 GiB = 724 MiB, down to a 256 MiB step
    assert (limits.device_soft, limits.device_hard) == (16 * GiB - overhead, 18 * GiB - overhead)


def test_d5_a_dry_run_gives_the_real_loads_verdict_on_the_device():
    from supervisor.policy.admission import fit_report

    s = snap(busy("a", 15))
    report = fit_report(s, "big", 8 * GiB, kv_per_token=0, context_tokens=0)
    verdict = admit(s, "big", 8 * GiB)
    assert (report.fits, report.pool, report.error, report.message) == (
        verdict.admitted, "device", verdict.error, verdict.message)
