"""SPEC P1-P5 and P7-P10 (and T6, C1, C2 as the tick sees them), one table per rule; P6,
eviction toward soft, is tests/test_p_eviction.py.

The guard (tests/pressure_harness.py) uses the custom tier with a 10 GiB ceiling
on a 64 GiB machine and explicit thresholds, so soft is 8 GiB and hard 9 GiB:
every figure below is plain arithmetic.
"""

from __future__ import annotations

import msgspec
import pytest

from shared.host import HostCounters
from shared.sizes import GiB
from supervisor.policy import decisions as d
from supervisor.policy.pressure import DESTRUCTIVE, tick
from supervisor.policy.snapshot import GuardSettings
from tests.pressure_harness import CEIL, GUARD, NOW, acts, busy, of, run, snap, w

# --- P1 level ---------------------------------------------------------------


@pytest.mark.parametrize(
    "usage, level",
    [(7.9, "ok"), (8.5, "soft"), (9.5, "hard"), (12.0, "hard")],
)
def test_p1_level_from_watermarks(usage, level):
    assert tick(snap(busy("a", usage))).level == level


def test_p1_boundaries_soft_and_hard_are_inclusive():
    probe = tick(snap()).ceilings
    at_soft = snap(supervisor_footprint=probe.soft)
    at_hard = snap(supervisor_footprint=probe.hard)
    assert tick(snap(supervisor_footprint=probe.soft - 1)).level == "ok"
    assert tick(at_soft).level == "soft"
    assert tick(at_hard).level == "hard"


def test_p1_level_change_is_a_decision_with_figures():
    r = tick(snap(busy("a", 8.5)))
    (change,) = of(r, d.LevelChanged)
    assert (change.from_level, change.to_level) == ("ok", "soft")
    assert change.usage == r.usage and change.ceiling == CEIL
    assert b'"from":"ok","to":"soft"' in msgspec.json.encode(change)
    assert not of(run(snap(busy("a", 8.5)), snap(busy("a", 8.6))), d.LevelChanged)


# --- P2 emergency -----------------------------------------------------------


def test_p2_emergency_by_margin_on_the_first_tick():
    r = tick(snap(busy("a", 12.0)))
    assert r.emergency and r.state.over_ceiling_ticks == 1


def test_p2_emergency_by_consecutive_ticks():
    over = snap(busy("a", 10.5))
    first = tick(over)
    assert not first.emergency and first.state.over_ceiling_ticks == 1
    second = run(over, over)
    assert second.emergency and second.state.over_ceiling_ticks == 2


def test_p2_count_resets_below_the_ceiling():
    r = run(snap(busy("a", 10.5)), snap(busy("a", 9.5)), snap(busy("a", 10.5)))
    assert not r.emergency and r.state.over_ceiling_ticks == 1


def test_p2_p7_recheck_after_acting_does_not_count_a_tick_but_resets():
    """The enforcer re-ticks right after acting; counting that as a second tick
    over the ceiling would declare an emergency (and abort pinned work) after
    a single poll."""
    over = snap(busy("a", 10.5))
    again = run(over, snap(busy("a", 10.5), recheck=True))
    assert not again.emergency and again.state.over_ceiling_ticks == 1
    below = run(over, snap(busy("a", 9.0), recheck=True))
    assert below.state.over_ceiling_ticks == 0


def test_p2_emergency_never_without_a_ceiling():
    off = GuardSettings(enabled=False)
    r = run(snap(busy("a", 70.0), guard=off), snap(busy("a", 70.0), guard=off))
    assert not r.emergency and r.level == "ok"


# --- P3 admission -----------------------------------------------------------


def test_p3_pause_at_pressure_once_and_resume_at_ok():
    soft = snap(busy("a", 8.5))
    first = tick(soft)
    assert len(of(first, d.PauseAdmission)) == 1 and first.state.admission_paused
    assert all(x.limits.admission_paused for x in of(first, d.ApplyLimits))
    assert not of(run(soft, soft), d.PauseAdmission)
    resumed = run(soft, snap(busy("a", 5.0)))
    assert len(of(resumed, d.ResumeAdmission)) == 1 and not resumed.state.admission_paused
    assert all(not x.limits.admission_paused for x in of(resumed, d.ApplyLimits))


# --- P4 reclaim grace -------------------------------------------------------


def test_p4_fat_pool_gets_a_grace_tick_before_anything_destructive():
    """Killing a model whose allocator pool could simply be returned at the
    next step boundary throws away a loaded model for memory that was free."""
    s = snap(w("idle", 3.0), busy("fat", 7.0, mlx_pool=3 * GiB))
    r = tick(s)
    assert r.level == "hard"
    assert acts(r) == [("reclaim", "fat")]
    assert not of(r, d.ReclaimPool)[0].idle_only
    assert r.state.grace_ticks == 1


def test_p4_grace_budget_exhausted_then_destructive():
    """A pool that never drains must not defer eviction forever (livelock)."""
    s = snap(w("idle", 2.5), busy("fat", 7.0, mlx_pool=3 * GiB))  # hard, below the ceiling
    r = run(*[s] * 5)
    assert r.state.grace_ticks == 5 and acts(r) == [("reclaim", "fat")]
    sixth = run(*[s] * 6)
    assert ("stop", "idle") in acts(sixth)


def test_p4_grace_budget_resets_when_level_returns_to_ok():
    s = snap(w("idle", 2.5), busy("fat", 7.0, mlx_pool=3 * GiB))
    calm = snap(busy("fat", 5.0, mlx_pool=3 * GiB))
    r = run(*[s] * 5, calm)
    assert r.state.grace_ticks == 0
    assert acts(run(*[s] * 5, calm, s)) == [("reclaim", "fat")]


def test_p4_no_grace_in_emergency_small_pool_or_env_switch():
    fat = busy("fat", 7.0, mlx_pool=3 * GiB)
    emergency = tick(snap(w("idle", 6.0), fat))  # 13 GiB >= ceiling + 2 GiB
    assert emergency.emergency and ("stop", "idle") in acts(emergency)
    small = tick(snap(w("idle", 3.0), busy("b", 7.0, mlx_pool=2 * GiB)))
    assert ("stop", "idle") in acts(small)
    switched = tick(snap(w("idle", 3.0), fat,
                         guard=msgspec.structs.replace(GUARD, pressure_reclaim_disabled=True)))
    assert acts(switched) == [("stop", "idle")]


def test_p4_recheck_does_not_spend_grace():
    s = snap(w("idle", 3.0), busy("fat", 7.0, mlx_pool=3 * GiB))
    r = run(s, msgspec.structs.replace(s, recheck=True))
    assert r.state.grace_ticks == 1 and acts(r) == [("reclaim", "fat")]


# --- P5 hot-cache shrink ----------------------------------------------------


def test_p5_hard_shrinks_hot_cache_lru_then_reclaims_and_stops_if_enough():
    """Shrunk cache blocks land in the allocator pool: without the reclaim that
    follows, the bytes never left the process, usage did not drop, and the old
    enforcer concluded "nothing to evict" and livelocked until restart."""
    # 9.5 GiB, soft 8: need 1.5 GiB; "old" releases 1, "new" the rest.
    old = busy("old", 5.0, last_access=10, cache_bytes=2 * GiB, cache_releasable=GiB)
    new = busy("new", 4.5, last_access=20, cache_bytes=2 * GiB, cache_releasable=2 * GiB)
    r = tick(snap(old, new))
    shrinks = of(r, d.ShrinkHotCache)
    assert [(x.worker, x.target_bytes) for x in shrinks] == [("old", GiB), ("new", int(1.5 * GiB))]
    assert [x.worker for x in of(r, d.ReclaimPool)] == ["old", "new"]
    assert r.projected_usage == 8 * GiB
    assert not of(r, d.AbortWorkerRequests) and not of(r, d.Stop)


def test_p5_never_asks_for_blocks_requests_use_then_evicts():
    """Protected blocks cannot be freed; projecting them as freed would leave
    the guard waiting on memory that never comes back (livelock)."""
    a = busy("a", 5.0, cache_bytes=3 * GiB, cache_releasable=0)
    r = tick(snap(a, w("idle", 4.5)))
    assert not of(r, d.ShrinkHotCache)
    assert ("stop", "idle") in acts(r)


def test_p5_not_at_soft():
    r = tick(snap(busy("a", 8.5, cache_bytes=GiB, cache_releasable=GiB)))
    assert r.level == "soft" and not of(r, d.ShrinkHotCache)


# --- P8 concurrency walk ----------------------------------------------------


@pytest.mark.parametrize(
    "usage, concurrency, expected",
    [(2.0, 1, 2), (2.0, 3, 4), (2.0, 4, None), (8.5, 4, 3), (8.5, 1, None), (9.5, 0, 3)],
)
def test_p8_concurrency_moves_one_step_per_tick(usage, concurrency, expected):
    r = tick(snap(busy("a", usage, concurrency=concurrency, max_concurrency=4)))
    caps = [x.cap for x in of(r, d.SetConcurrency)]
    assert caps == ([] if expected is None else [expected])


def test_p8_recheck_does_not_walk():
    r = tick(snap(busy("a", 2.0, concurrency=1), recheck=True))
    assert not of(r, d.SetConcurrency)


def test_p8_a_step_carries_the_worker_s_whole_limits_with_the_new_cap():
    """The policy's decisions are complete, one per worker: the enforcer sends them as they
    are, merging nothing (a takes a step, b is at its maximum)."""
    r = tick(snap(busy("a", 2.0, concurrency=2, max_concurrency=4), busy("b", 2.0, concurrency=4, max_concurrency=4)))
    [given] = of(r, d.ApplyLimits)
    [step] = of(r, d.SetConcurrency)
    assert (given.worker, given.limits.max_concurrency) == ("b", 4)
    assert (step.worker, step.cap, step.limits.max_concurrency) == ("a", 3, 3)
    assert msgspec.structs.replace(step.limits, max_concurrency=4) == given.limits
    assert r.state.caps == {"a": 3, "b": 4}


def test_t6_p8_every_worker_s_limits_come_in_one_decision_in_worker_order():
    """T6/P8: one HandOutLimits carries every worker told something this tick, in snapshot
    order, each entry the whole limits (a step's cap is its limits' max_concurrency)."""
    r = tick(snap(busy("c", 2.0, concurrency=2, max_concurrency=4), busy("a", 2.0, concurrency=4),
                  busy("b", 2.0, concurrency=1, max_concurrency=2)))
    [batch] = [x for x in r.decisions if isinstance(x, d.HandOutLimits)]
    assert [x for x in r.decisions if isinstance(x, (d.ApplyLimits, d.SetConcurrency))] == []
    assert [(w_, step, limits.max_concurrency) for w_, _m, limits, _why, step in batch.entries] == [
        ("c", True, 3), ("a", False, 4), ("b", True, 2)]
    assert [(type(x), x.worker) for x in batch.spelt_out()] == [
        (d.SetConcurrency, "c"), (d.ApplyLimits, "a"), (d.SetConcurrency, "b")]
    at = r.decisions.index(batch)  # per_worker spells it out in its place
    assert d.per_worker(r.decisions) == r.decisions[:at] + batch.spelt_out() + r.decisions[at + 1:]


def test_t6_a_cap_changed_outside_the_policy_is_handed_out_again():
    """A spare that took a model (W1) runs with its model's cap: the limits it held as a spare
    said 1. The policy keeps the cap each worker's limits carry and hands them out again."""
    spare = w("s", model="", state="spare", pid=5, concurrency=1, max_concurrency=1)
    took = w("s", model="m-s", state="loading", pid=5, concurrency=4, max_concurrency=4)
    r = run(snap(spare), snap(took))
    assert [(x.worker, x.limits.max_concurrency, x.reason) for x in of(r, d.ApplyLimits)] == [
        ("s", 4, "its request slots changed")]
    assert not of(run(snap(spare), snap(took), snap(took)), d.ApplyLimits)


# --- P9 cadence -------------------------------------------------------------


@pytest.mark.parametrize(
    "workers, extra, interval",
    [
        ((), {}, 30.0),
        ((w("a"),), {}, 10.0),
        ((busy("a"),), {}, 1.0),
        ((w("a", queued=1),), {}, 1.0),
        ((w("a", state="loading"),), {}, 1.0),
        ((w("a", state="wedged"),), {}, 1.0),
        ((w("a", 8.5),), {}, 1.0),  # pressure
        ((w("a"),), {"activity_hint": NOW - 1.5}, 1.0),
        ((w("a"),), {"activity_hint": NOW - 2.5}, 10.0),
        ((w("a", state="dead"),), {}, 30.0),
    ],
)
def test_p9_cadence(workers, extra, interval):
    r = tick(snap(*workers, **extra))
    assert r.next_interval == interval and r.state.interval == interval


def test_p9_p10_a_quiet_cadence_still_wakes_for_the_next_ttl_expiry():
    g = msgspec.structs.replace(GUARD, idle_timeout=100.0)
    assert tick(snap(w("a", last_access=NOW - 96), guard=g)).next_interval == pytest.approx(4.01)
    assert tick(snap(w("a", last_access=NOW - 99.5), guard=g)).next_interval == 1.0
    assert tick(snap(w("a", last_access=NOW - 96, pinned=True), guard=g)).next_interval == 10.0


def test_p9_hint_window_is_twice_the_interval_when_longer_than_2s():
    g = msgspec.structs.replace(GUARD, poll_interval=3.0)
    assert tick(snap(w("a"), guard=g, activity_hint=NOW - 5.0)).next_interval == 3.0


# --- P10 TTL ----------------------------------------------------------------


def test_p10_ttl_per_model_then_global():
    g = msgspec.structs.replace(GUARD, idle_timeout=100.0)
    r = tick(snap(w("own", last_access=NOW - 60, ttl=50.0), w("glob", last_access=NOW - 101),
                  w("fresh", last_access=NOW - 99), guard=g))
    assert [x.worker for x in of(r, d.ExpireTTL)] == ["own", "glob"]


@pytest.mark.parametrize(
    "record",
    [
        w("pinned", last_access=0, pinned=True, ttl=1.0),
        busy("busy", last_access=0, ttl=1.0),
        w("never", last_access=0, ttl=0.0),
        w("exact", last_access=NOW - 5.0, ttl=5.0),
        w("loading", state="loading", last_access=0, ttl=1.0),
    ],
)
def test_p10_never_expires(record):
    assert not of(tick(snap(record)), d.ExpireTTL)


def test_p10_model_stopped_by_pressure_is_not_expired_twice():
    g = msgspec.structs.replace(GUARD, idle_timeout=10.0)
    r = tick(snap(w("idle", 2.0, last_access=0), busy("b", 7.5), guard=g))
    assert acts(r) == [("stop", "idle")]


# --- guard off, T2, T6, C1, C2 ---------------------------------------------


def test_guard_off_no_destructive_decision_and_admission_resumes():
    off = msgspec.structs.replace(GUARD, enabled=False)
    r = run(snap(busy("a", 9.5), w("b", 3.0)), snap(busy("a", 9.5), w("b", 3.0), guard=off))
    assert r.level == "ok" and r.ceilings.ceiling == 0
    assert not [x for x in r.decisions if isinstance(x, DESTRUCTIVE)]
    assert of(r, d.ResumeAdmission)
    assert all(x.limits.hard_limit == 0 for x in of(r, d.ApplyLimits))


def test_t6_new_limits_reach_every_worker_on_the_next_tick():
    workers = (w("a"), w("b"))
    steady = run(snap(*workers), snap(*workers))
    assert not of(steady, d.ApplyLimits)
    safe = msgspec.structs.replace(GUARD, tier="safe")
    changed = run(snap(*workers), snap(*workers, guard=safe))
    assert sorted(x.worker for x in of(changed, d.ApplyLimits)) == ["a", "b"]
    assert all(x.limits.tier == "safe" for x in of(changed, d.ApplyLimits))


def test_t6_new_or_respawned_worker_gets_limits():
    r = run(snap(w("a", pid=1)), snap(w("a", pid=1), w("b", pid=2)))
    assert [x.worker for x in of(r, d.ApplyLimits)] == ["b"]
    respawned = run(snap(w("a", pid=1)), snap(w("a", pid=7)))
    assert [x.worker for x in of(respawned, d.ApplyLimits)] == ["a"]
    assert of(respawned, d.ApplyLimits)[0].limits.max_concurrency == 4


def test_t6_a_replaced_worker_gets_limits_once():
    r = run(snap(w("a", pid=1), w("b", pid=2)), snap(w("a", pid=1), w("c", pid=3)),
            snap(w("a", pid=1), w("c", pid=3)))
    assert not of(r, d.ApplyLimits)
    assert r.state.limited == {"a": 1, "c": 3}


def test_c1_reserve_larger_than_machine_warns_once():
    g = GuardSettings(tier="safe")
    small = HostCounters(total=4 * GiB, free=3 * GiB)
    first = tick(snap(guard=g, host=small))
    assert [x.reason for x in of(first, d.Warn)] == ["C1"]
    assert first.ceilings.ceiling == 1
    assert not of(run(snap(guard=g, host=small), snap(guard=g, host=small)), d.Warn)


def test_c2_no_counters_warns_once_and_uses_static():
    g = GuardSettings(tier="balanced")
    first = tick(snap(guard=g, host=HostCounters(total=32 * GiB)))
    assert [x.reason for x in of(first, d.Warn)] == ["C2"]
    assert first.ceilings.ceiling == first.ceilings.static
    again = run(snap(guard=g, host=HostCounters(total=32 * GiB)), snap(guard=g, host=None))
    assert not of(again, d.Warn) and again.ceilings.total == 32 * GiB


def test_c2_no_reading_ever_holds_still():
    """Guessing the machine's size would either lift every limit or (static = 1
    byte) evict every model; with no reading at all the policy does nothing."""
    s = snap(busy("a", 50.0), w("b", 3.0), host=None)
    r = tick(s)
    assert [type(x) for x in r.decisions] == [d.Warn]
    assert not run(s, s).decisions


def test_tick_is_pure_same_snapshot_same_result():
    s = snap(w("a", 2.0, last_access=1), busy("b", 7.5, mlx_pool=GiB), w("c", state="loading"))
    assert msgspec.json.encode(tick(s)) == msgspec.json.encode(tick(s))
