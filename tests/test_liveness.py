"""The heartbeat and wedge checks (supervisor.workers.liveness), as tables of timestamps:
what a worker's silence means while it loads, between steps and inside one long
engine step, and what a stall of the supervisor's own loop forgives."""

import pytest

from shared import protocol as p
from supervisor.config import SupervisorConfig
from supervisor.workers import liveness
from supervisor.workers.liveness import STARTUP_GRACE, Beats

SCFG = SupervisorConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, load_timeout=60.0, step_timeout=30.0)


def alive(step: float) -> p.Alive:
    return p.Alive(worker_id="a#1", pid=1, step_seconds=step, loop_seconds=step, steps=3)


@pytest.mark.parametrize("beats, now, why", [
    (Beats(spawned_at=0, last_pong=0), 4.0, None),  # loading, within the window
    (Beats(spawned_at=0, last_pong=0), 5 + STARTUP_GRACE + 1, "no heartbeat for 16.0 s while starting or loading"),
    (Beats(spawned_at=0, last_pong=0, last_alive=50, alive=alive(0)), 54.0, None),  # reports, within the load
    (Beats(spawned_at=0, last_pong=0, last_alive=50, alive=alive(0)), 56.0, "no heartbeat for 6.0 s while starting or loading"),
    (Beats(spawned_at=0, last_pong=0, last_alive=60, alive=alive(0)), 61.0, "still loading after 61 s"),
])
def test_a_loading_worker_is_judged_by_its_heartbeat_thread_and_the_load_timeout(beats, now, why):
    assert liveness.wedged(beats, True, now, SCFG) == why


@pytest.mark.parametrize("beats, now, why", [
    (Beats(spawned_at=0, last_pong=10), 14.0, None),
    (Beats(spawned_at=0, last_pong=10), 16.0, "no heartbeat for 6.0 s"),
    # inside one engine step for 12 s, reported a second ago: alive
    (Beats(spawned_at=0, last_pong=10, last_alive=21, alive=alive(11.0)), 22.0, None),
    # the step has run past step_timeout: wedged, with the step's length
    (Beats(spawned_at=0, last_pong=10, last_alive=40, alive=alive(30.0)), 41.0,
     "one engine step has run for 31 s (supervisor.step_timeout 30 s)"),
    # its thread's report is stale: it says nothing of now
    (Beats(spawned_at=0, last_pong=10, last_alive=11, alive=alive(1.0)), 17.0, "no heartbeat for 7.0 s"),
])
def test_a_serving_worker_is_wedged_when_silent_and_not_inside_a_long_step(beats, now, why):
    assert liveness.wedged(beats, False, now, SCFG) == why


def test_unresponsive_past_half_the_window_unless_inside_a_step():
    quiet = Beats(spawned_at=0, last_pong=10)
    assert liveness.unresponsive(quiet, 12.0, SCFG) is None
    assert liveness.unresponsive(quiet, 13.0, SCFG) == 3.0
    stepping = Beats(spawned_at=0, last_pong=10, last_alive=12.5, alive=alive(2.0))
    assert liveness.unresponsive(stepping, 13.0, SCFG) is None


def test_a_stall_of_the_loop_gives_a_fresh_window_and_pushes_a_load_timeout_back():
    b = Beats(spawned_at=0, last_pong=10, last_alive=11, alive=alive(0))
    fresh = liveness.forgiven(b, 30.0, 15.0, loading=True)
    assert (fresh.spawned_at, fresh.last_pong, fresh.last_alive) == (15.0, 30.0, 30.0)
    assert liveness.forgiven(Beats(spawned_at=0, last_pong=10), 30.0, 15.0, loading=False).last_alive == 0.0
    assert liveness.wedged(fresh, False, 34.0, SCFG) is None


def test_the_stall_threshold_is_at_most_half_the_heartbeat_window():
    assert liveness.stall_threshold(SCFG) == 1.0
    assert liveness.stall_threshold(SupervisorConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5)) == 0.25
