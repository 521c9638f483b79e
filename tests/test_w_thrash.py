"""SPEC W5 as table tests: thrash found in a log of swaps, and the hand-over of a swap.

Pure functions (supervisor.policy.thrash): times are arguments, nothing reads a clock.
"""

from __future__ import annotations

import pytest

from shared.host import HostCounters
from shared.sizes import GiB, MiB
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.thrash import (
    HOLD_SETTLE,
    SETTLE,
    Swap,
    Thrash,
    changes,
    hand_over,
    in_the_way,
    recent,
    thrashing,
    together,
)
from tests.records import record


def swaps(*pairs: str, start: float = 0.0, every: float = 1.0) -> list[Swap]:
    """'ab' = a load of a stopped b; one swap every `every` seconds from `start`."""
    return [Swap(t=start + i * every, loaded=pair[0], evicted=pair[1]) for i, pair in enumerate(pairs)]


# (name, swaps, now, limit, window, expected sets as (models, swaps))
THRASH_TABLE = [
    ("two models taking turns, 4 swaps > 3", swaps("ba", "ab", "ba", "ab"), 10.0, 3, 60.0, [(("a", "b"), 4)]),
    ("exactly thrash_swaps is not more than it", swaps("ba", "ab", "ba"), 10.0, 3, 60.0, []),
    ("three in rotation are one set", swaps("ba", "cb", "ac", "ba", "cb"), 10.0, 3, 60.0, [(("a", "b", "c"), 5)]),
    ("a scan through models that never come back", swaps("ba", "cb", "dc", "ed", "fe"), 10.0, 3, 60.0, []),
    ("swaps older than the window do not count", swaps("ba", "ab", "ba", "ab", every=30.0), 100.0, 3, 60.0, []),
    ("the window includes its start", swaps("ba", "ab", "ba", "ab", start=40.0), 100.0, 3, 60.0, [(("a", "b"), 4)]),
    ("one direction only is no thrash", swaps("ba", "ba", "ba", "ba"), 10.0, 3, 60.0, []),
    ("two separate pairs", swaps("ba", "ab", "ba", "ab", "dc", "cd", "dc", "cd"), 10.0, 3, 60.0,
     [(("a", "b"), 4), (("c", "d"), 4)]),
    ("a third model's swap outside the pair is not counted",
     swaps("ba", "ab", "ca", "ba", "ab"), 10.0, 3, 60.0, [(("a", "b"), 4)]),
    ("thrash_swaps = 1: two swaps back and forth", swaps("ba", "ab"), 10.0, 1, 60.0, [(("a", "b"), 2)]),
]


@pytest.mark.parametrize("name,log,now,limit,window,expected", THRASH_TABLE, ids=[t[0] for t in THRASH_TABLE])
def test_w5_thrash_is_models_evicting_each_other_more_than_thrash_swaps_times(name, log, now, limit, window,
                                                                                expected):
    found = thrashing(log, now, limit=limit, window=window)
    assert [(g.models, g.swaps) for g in found] == expected


def test_w5_recent_keeps_the_window():
    log = swaps("ba", "ab", "ba", every=10.0)
    assert recent(log, 25.0, 10.0) == log[2:] + [] and recent(log, 20.0, 10.0) == log[1:]


def test_w5_together_needs_every_model_in_one_set():
    groups = [Thrash(models=("a", "b"), swaps=4)]
    assert together(groups, "a", ["b"])
    assert not together(groups, "a", ["b", "c"])
    assert not together(groups, "c", ["a"])
    assert not together([], "a", ["b"])


def test_w5_an_episode_is_said_once_when_it_begins_and_once_when_it_ends():
    ab4, ab5 = Thrash(models=("a", "b"), swaps=4), Thrash(models=("a", "b"), swaps=5)
    abc = Thrash(models=("a", "b", "c"), swaps=6)
    assert changes([], [ab4]) == ([ab4], [])
    assert changes([ab4], [ab5]) == ([], [])  # more swaps in the same set: no news
    assert changes([ab4], [abc]) == ([abc], [])  # a model joins: said again
    assert changes([ab5], []) == ([], [ab5])


# (name, waited, quiet, thrashing, hold, commit, expected); quiet: seconds since the model had work
HAND_OVER_TABLE = [
    ("W5 off (hold 0): admission at once, busy or not", 0.0, 0.0, True, 0.0, 60.0, "go"),
    ("nothing left to serve: go", 0.0, HOLD_SETTLE, True, 2.0, 60.0, "go"),
    ("the hold ends as soon as the loaded model has nothing queued", 1.0, HOLD_SETTLE, True, 2.0, 60.0, "go"),
    ("... but not in the gap before a client's next request", 1.0, SETTLE / 2, True, 2.0, 60.0, "hold"),
    ("... nor in that gap on a loaded machine (0.1 s; it ended a 2 s hold at 0.7 s)", 1.0, 0.1, True, 2.0, 60.0,
     "hold"),
    ("closed: nothing new comes, the short settle is enough", 2.5, SETTLE, True, 2.0, 60.0, "go"),
    ("thrashing: the loaded model keeps serving", 0.0, 0.0, True, 2.0, 60.0, "hold"),
    ("thrashing: ... for up to thrash_hold", 1.99, 0.0, True, 2.0, 60.0, "hold"),
    ("thrashing: then it is closed and finishes what it has", 2.0, 0.0, True, 2.0, 60.0, "close"),
    ("thrashing: a closed model is waited for up to the commit", 61.9, 0.0, True, 2.0, 60.0, "close"),
    ("thrashing: past hold + commit, admission decides", 62.0, 0.0, True, 2.0, 60.0, "give_up"),
    ("not thrashing: closed at once, never held open", 0.0, 0.0, False, 2.0, 60.0, "close"),
    ("not thrashing: waited for up to the commit", 59.0, 0.0, False, 2.0, 60.0, "close"),
    ("not thrashing: past the commit, admission decides", 60.0, 0.0, False, 2.0, 60.0, "give_up"),
    ("not thrashing: a closed model that is done: go", 0.5, SETTLE, False, 2.0, 60.0, "go"),
]


@pytest.mark.parametrize("name,waited,quiet,thrash,hold,commit,expected", HAND_OVER_TABLE,
                         ids=[t[0] for t in HAND_OVER_TABLE])
def test_w5_hand_over(name, waited, quiet, thrash, hold, commit, expected):
    assert hand_over(waited=waited, quiet=quiet, thrashing=thrash, hold=hold, commit=commit) == expected


def test_w5_a_held_request_waits_at_most_thrash_hold_for_its_swap_to_begin():
    """Whatever the loaded model keeps doing, the hold is over after thrash_hold: from
    then on it takes nothing new (closed), so the swap has begun."""
    for waited in (2.0, 2.5, 10.0):
        assert hand_over(waited=waited, quiet=0.0, thrashing=True, hold=2.0, commit=60.0) != "hold"


def _worker(worker: str, model: str, usage: int, *, running: int = 0, pinned: bool = False) -> WorkerRecord:
    return record(worker=worker, model=model, state="busy" if running else "ready", running=running,
                  pinned=pinned, usage=usage, footprint=usage)


def _snapshot(*workers: WorkerRecord, ceiling: int = 1 * GiB) -> Snapshot:
    """A 64 GiB machine under a custom ceiling (soft 0.97): only the ceiling binds."""
    guard = GuardSettings(tier="custom", custom_ceiling=ceiling, soft_threshold=0.97, hard_threshold=0.99)
    host = HostCounters(total=64 * GiB, free=60 * GiB, inactive=0, file_backed=0, active=1 * GiB)
    return Snapshot(now=100.0, guard=guard, host=host, supervisor_footprint=50 * MiB, workers=list(workers))


def test_w5_in_the_way_names_a_busy_model_admission_would_stop_were_it_idle():
    snap = _snapshot(_worker("a#1", "a", 600 * MiB, running=2))
    assert in_the_way(snap, "b", 400 * MiB) == ["a#1"]


def test_w5_in_the_way_is_empty_when_the_load_fits_beside_it():
    snap = _snapshot(_worker("a#1", "a", 200 * MiB, running=2))
    assert in_the_way(snap, "b", 100 * MiB) == []


def test_w5_in_the_way_is_empty_when_the_load_would_be_refused_anyway():
    """A3: a model too large even alone waits for nobody (and stops nobody)."""
    snap = _snapshot(_worker("a#1", "a", 600 * MiB, running=2))
    assert in_the_way(snap, "b", 2 * GiB) == []


def test_w5_a_pinned_model_is_never_in_the_way():
    snap = _snapshot(_worker("a#1", "a", 600 * MiB, running=2, pinned=True))
    assert in_the_way(snap, "b", 400 * MiB) == []
