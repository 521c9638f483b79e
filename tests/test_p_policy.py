"""SPEC P1-P10 (and T6, C1, C2 as the tick sees them), one table per rule.

The guard here uses the custom tier with a 10 GiB ceiling on a 64 GiB machine
and explicit thresholds, so soft is 8 GiB and hard 9 GiB: every figure below
is plain arithmetic.
"""

from __future__ import annotations

import msgspec
import pytest

from shared.host import HostCounters
from shared.sizes import GiB
from supervisor.policy import decisions as d
from supervisor.policy.pressure import DESTRUCTIVE, tick
from supervisor.policy.snapshot import GuardSettings, PolicyState, Snapshot, WorkerRecord
from tests.records import record

CEIL = 10 * GiB
GUARD = GuardSettings(tier="custom", custom_ceiling=CEIL, soft_threshold=0.8, hard_threshold=0.9)
HOST = HostCounters(total=64 * GiB)
NOW = 1000.0


def w(name: str, gib: float = 1.0, **kw) -> WorkerRecord:
    """A worker using `gib` GiB (usage = footprint), ready and idle unless told."""
    size = int(gib * GiB)
    kw.setdefault("model", f"m-{name}")
    kw.setdefault("footprint", size)
    return record(worker=name, usage=size, **kw)


def busy(name: str, gib: float = 1.0, **kw) -> WorkerRecord:
    return w(name, gib, state="busy", running=1, **kw)


def snap(*workers: WorkerRecord, state: PolicyState | None = None, guard: GuardSettings = GUARD,
         **kw) -> Snapshot:
    kw.setdefault("now", NOW)
    kw.setdefault("host", HOST)
    return Snapshot(guard=guard, workers=list(workers), state=state or PolicyState(), **kw)


def acts(result) -> list[tuple[str, str]]:
    """The actions on workers, in order (limits and concurrency left out)."""
    return [(x.__struct_config__.tag, x.worker) for x in result.decisions
            if hasattr(x, "worker") and not isinstance(x, (d.ApplyLimits, d.SetConcurrency))]


def of(result, kind) -> list:
    """The decisions of one kind, the tick's HandOutLimits spelt out as one decision a worker."""
    return [x for x in d.per_worker(result.decisions) if isinstance(x, kind)]


def run(*snaps: Snapshot):
    """Tick a sequence, feeding each state into the next like the enforcer."""
    state, result = None, None
    for s in snaps:
        if state is not None:
            s = msgspec.structs.replace(s, state=state)
        result = tick(s)
        state = result.state
    return result


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


# --- P6 eviction toward soft ------------------------------------------------


def test_p6_step1_drained_marked_worker_goes_first():
    r = tick(snap(w("lru", 2.0, last_access=1), w("marked", 2.0, last_access=900,
                                                   marked_for_unload=True), busy("b", 5.5)))
    assert acts(r)[0] == ("stop", "marked")


def test_p6_step2_lru_idle_at_hard_stops_as_soon_as_below_soft():
    r = tick(snap(w("old", 1.5, last_access=1), w("mid", 1.5, last_access=2),
                  w("new", 1.5, last_access=3), busy("b", 5.0)))
    # 9.5 GiB: one stop -> 8.0, at soft, done
    assert acts(r) == [("stop", "old")]
    assert r.projected_usage == 8 * GiB


def test_p6_step2_at_soft_with_two_non_pinned_stops_lru():
    r = tick(snap(w("old", 1.0, last_access=1), busy("b", 7.5)))
    assert r.level == "soft" and acts(r) == [("stop", "old")]


def test_p6_step2_soft_pressure_with_a_single_non_pinned_model_keeps_it():
    """At soft the admission pause is enough; stopping the only non-pinned model
    would empty the machine for a pressure that needs no action."""
    r = tick(snap(w("only", 2.0), busy("p", 6.5, pinned=True)))
    assert r.level == "soft" and acts(r) == []
    assert of(r, d.PauseAdmission)


def test_p6_step2_hard_stops_even_the_last_non_pinned_idle_model():
    r = tick(snap(w("only", 2.0), busy("p", 7.5, pinned=True)))
    assert r.level == "hard" and acts(r) == [("stop", "only")]


def test_p6_step3_hard_busy_victim_aborted_and_kept_loaded():
    r = tick(snap(busy("old", 4.0, last_access=1), busy("new", 5.5, last_access=2)))
    assert acts(r) == [("abort_requests", "old")]
    assert not r.emergency


def test_p6_step3_emergency_busy_victim_marked_for_unload():
    r = run(snap(busy("old", 5.0, last_access=1), busy("new", 5.5, last_access=2)),
            snap(busy("old", 5.0, last_access=1), busy("new", 5.5, last_access=2)))
    assert r.emergency
    assert acts(r) == [("abort_requests", "old"), ("mark_for_unload", "old")]


def test_p6_step4_hard_aborts_every_load_in_progress():
    r = tick(snap(busy("p", 8.0, pinned=True), w("l1", 1.0, state="loading"),
                  w("l2", 0.5, state="starting")))
    assert acts(r) == [("abort_load", "l1"), ("abort_load", "l2")]


def test_p6_step5_emergency_aborts_pinned_requests_keeping_them_loaded():
    """Last-resort brake: past the real ceiling by 2 GiB the machine is about to
    panic or jetsam; pinned work is aborted but the models stay loaded."""
    r = tick(snap(busy("p1", 6.0, pinned=True), busy("p2", 6.5, pinned=True), w("p3", 1, pinned=True)))
    assert r.emergency
    assert acts(r) == [("abort_requests", "p1"), ("abort_requests", "p2")]


def test_p6_step6_everything_pinned_hard_asks_idle_reclaim_only():
    r = tick(snap(busy("p1", 5.0, pinned=True), w("p2", 4.5, pinned=True)))
    assert r.level == "hard" and not r.emergency
    assert acts(r) == [("reclaim", "p1"), ("reclaim", "p2")]
    assert all(x.idle_only for x in of(r, d.ReclaimPool))


def test_p6_everything_pinned_at_soft_only_pauses():
    r = tick(snap(busy("p1", 5.0, pinned=True), w("p2", 3.5, pinned=True)))
    assert r.level == "soft" and acts(r) == [] and of(r, d.PauseAdmission)


def test_p6_pinned_models_are_never_stopped_by_pressure():
    r = run(*[snap(w("p1", 6.0, pinned=True), w("p2", 7.0, pinned=True))] * 3)
    assert r.emergency
    assert not of(r, d.Stop) and not of(r, d.MarkForUnload)


def test_p6_draining_workers_are_not_chosen_and_count_as_going():
    """A stop already under way frees its memory soon; counting it again made
    the guard stop a second model for the same bytes."""
    r = tick(snap(w("gone", 3.0, state="draining"), w("idle", 1.0), w("still", 5.5)))
    assert r.level == "hard" and r.usage == int(9.5 * GiB)
    assert acts(r) == []  # 9.5 - 3 = 6.5 GiB <= soft, and nothing grows meanwhile
    more = tick(snap(w("gone", 1.0, state="draining"), w("idle", 1.0), w("still", 7.5)))
    assert acts(more) == [("stop", "idle")]
    soft = tick(snap(w("gone", 2.0, state="draining"), w("idle", 1.0), busy("b", 5.5)))
    assert soft.level == "soft" and acts(soft) == []  # at soft the stop under way is enough


def test_p6_at_hard_a_growing_worker_is_acted_on_while_another_stop_is_under_way():
    """A 1 GiB/s grower while an idle model was being stopped went
    44-61 % over the ceiling, because the draining model's bytes were counted
    as gone and nothing else happened until it had exited. A stop takes
    100-300 ms: when the group grows fast enough to reach the ceiling before
    the stop lands, the next victim is acted on at once."""
    first = snap(w("gone", 3.0, state="draining"), busy("grower", 4.0))
    later = snap(w("gone", 3.0, state="draining"), busy("grower", 6.2), now=NOW + 0.1)
    r = run(first, later)  # 2.2 GiB in 0.1 s: the ceiling is 0.03 s away
    assert r.level == "hard" and r.draining_credited == 0
    assert acts(r) == [("abort_requests", "grower")]
    still = run(first, snap(w("gone", 3.0, state="draining"), busy("grower", 6.2), now=NOW + 100))
    assert still.level == "hard" and acts(still) == []  # slow growth: the stop lands first
    over = run(snap(w("gone", 3.0, state="draining"), busy("flat", 7.5)),
               snap(w("gone", 3.0, state="draining"), busy("flat", 7.5), now=NOW + 1))
    assert over.usage > CEIL and acts(over) == []  # over the ceiling but not growing: wait for the stop



def test_p6_a_grower_that_crosses_soft_and_hard_within_50_ms_is_acted_on_at_hard():
    """Soft stopped the idle model; the grower reached hard 30 ms
    later, within GROWTH_WINDOW, and the tick kept the rate measured before the
    burst (0.2 GiB/s): the stop under way was credited and nothing was done
    until the idle model had exited (14.1 % over the ceiling)."""
    before = snap(w("big", 3.0), busy("grower", 4.9), now=NOW - 1)
    at_soft = snap(w("big", 3.0), busy("grower", 5.1))
    at_hard = snap(w("big", 3.0, state="draining"), busy("grower", 6.1), now=NOW + 0.03)
    soft = run(before, at_soft)
    assert soft.level == "soft" and acts(soft) == [("stop", "big")]
    r = run(before, at_soft, at_hard)
    assert r.level == "hard" and r.draining_credited == 0
    assert acts(r)[0] == ("abort_requests", "grower")


def test_p6_at_hard_the_grower_is_acted_on_first_whatever_the_sizes():
    """The stop under way (a big idle model: its exit takes hundreds of ms) would
    land before the ceiling by STOP_SECONDS' guess, yet the grower keeps
    growing: it is acted on at once, before another idle model is stopped."""
    first = snap(w("big", 3.0, state="draining"), w("idle", 0.5, last_access=1.0), busy("grower", 5.0))
    later = snap(w("big", 3.0, state="draining"), w("idle", 0.5, last_access=1.0), busy("grower", 5.55),
                 now=NOW + 1)  # 0.55 GiB/s: 0.9 GiB of room lasts 1.6 s
    r = run(first, later)
    assert r.level == "hard" and r.draining_credited == 0
    assert acts(r)[0] == ("abort_requests", "grower")
    idle_grower = run(snap(w("big", 3.0, state="draining"), w("drill", 5.5)),
                      snap(w("big", 3.0, state="draining"), w("drill", 6.05), now=NOW + 1))
    assert acts(idle_grower)[:2] == [("abort_requests", "drill"), ("stop", "drill")]
    pinned = run(snap(w("big", 3.0, state="draining"), busy("pin", 5.5, pinned=True)),
                 snap(w("big", 3.0, state="draining"), busy("pin", 6.05, pinned=True), now=NOW + 1))
    assert not [a for a in acts(pinned) if a[1] == "pin" and a[0] != "reclaim"]  # pinned: step 5 only
    slow = run(snap(w("big", 3.0, state="draining"), busy("grower", 6.0)),
               snap(w("big", 3.0, state="draining"), busy("grower", 6.01), now=NOW + 1))
    assert acts(slow) == []  # 10 MiB/s (a decode's KV): not a runaway, the stop lands first


def test_p6_3_marked_worker_is_stopped_once_drained_even_after_pressure_ends():
    """A marked model whose pressure had ended stayed loaded for ever: P6 step 1
    ran only over soft, and TTL skips marked workers."""
    r = tick(snap(w("marked", 1.0, marked_for_unload=True), w("other", 1.0)))
    assert r.level == "ok"
    assert acts(r) == [("stop", "marked")]
    still_busy = tick(snap(busy("marked", 1.0, marked_for_unload=True)))
    assert acts(still_busy) == []


def test_p6_dead_and_stopped_workers_hold_no_memory():
    r = tick(snap(w("dead", 50.0, state="dead"), w("stopped", 50.0, state="stopped"), busy("b", 2.0)))
    assert r.usage == 2 * GiB and r.level == "ok"


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


def test_p5_then_p6_6_asks_a_shrunk_worker_to_reclaim_once():
    """A pinned idle worker whose prompt cache P5 shrinks is asked to reclaim at its
    next step boundary; P6 step 6 must not add a second, idle-time reclaim for it
    (found by the property test `test_decisions_only_name_live_workers_once_per_kind`)."""
    pinned = w("w0", 9.5, pinned=True, cache_bytes=GiB // 4, cache_releasable=GiB // 4)
    r = tick(snap(pinned))
    assert r.level == "hard"
    kinds = [type(x) for x in r.decisions if getattr(x, "worker", None) == "w0"]
    assert kinds.count(d.ShrinkHotCache) == 1 and kinds.count(d.ReclaimPool) == 1
