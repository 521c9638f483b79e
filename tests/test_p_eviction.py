"""SPEC P6, eviction toward soft: the steps P6.1-P6.6 in order, the stops already under way,
the grower acted on at hard; and P5's shrink followed by P6.6's reclaim.

The guard (tests/pressure_harness.py): custom tier, 10 GiB ceiling on a 64 GiB
machine, soft 8 GiB, hard 9 GiB.
"""

from __future__ import annotations

from shared.sizes import GiB
from supervisor.policy import decisions as d
from supervisor.policy.pressure import tick
from tests.pressure_harness import CEIL, NOW, acts, busy, of, run, snap, w

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


def test_p5_then_p6_6_asks_a_shrunk_worker_to_reclaim_once():
    """A pinned idle worker whose prompt cache P5 shrinks is asked to reclaim at its
    next step boundary; P6 step 6 must not add a second, idle-time reclaim for it
    (found by the property test `test_decisions_only_name_live_workers_once_per_kind`)."""
    pinned = w("w0", 9.5, pinned=True, cache_bytes=GiB // 4, cache_releasable=GiB // 4)
    r = tick(snap(pinned))
    assert r.level == "hard"
    kinds = [type(x) for x in r.decisions if getattr(x, "worker", None) == "w0"]
    assert kinds.count(d.ShrinkHotCache) == 1 and kinds.count(d.ReclaimPool) == 1
