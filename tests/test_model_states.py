"""A model's state table (supervisor.model_states) and its restart intensity and
backoff (supervisor.intensity): every legal move, illegal moves said loudly, and
the arithmetic of when a model comes back, as tables."""

import pytest

from supervisor import intensity
from supervisor.config import SupervisorConfig
from supervisor.model_states import MODEL_TRANSITIONS, IllegalModelMove, model_transition

SCFG = SupervisorConfig(restart_max=3, restart_period=60.0, failed_retry_first=5.0, failed_retry_max=80.0)


@pytest.mark.parametrize("state, event, after", [
    ("steady", "load", "loading"),
    ("loading", "done", "steady"),
    ("steady", "exit", "respawning"),  # its pinned worker exited
    ("loading", "exit", "respawning"),  # it died while loading
    ("respawning", "load", "loading"),  # the respawn (due, or a request came first)
    ("respawning", "done", "respawning"),  # a load that ended after its worker exited
    ("loading", "give_up", "failed"),
    ("respawning", "give_up", "failed"),
    ("failed", "done", "failed"),  # a load that ended after the model was given up
    ("failed", "give_up", "failed"),
    ("failed", "retry", "steady"),
])
def test_each_legal_move(state, event, after):
    assert model_transition(state, event) == after


@pytest.mark.parametrize("state, event", [
    ("steady", "done"),  # no load in flight to end
    ("steady", "retry"),  # nothing failed
    ("loading", "load"),  # a second load of one model: callers join the one in flight (A5)
    ("respawning", "exit"),  # already coming back
    ("failed", "load"),  # a failed model loads only after a retry
    ("failed", "exit"),
])
def test_an_illegal_move_raises_instead_of_undoing_a_decision(state, event):
    with pytest.raises(IllegalModelMove, match=f"{state!r} cannot take event {event!r}"):
        model_transition(state, event)


def test_every_state_can_be_left_or_given_up():
    assert all("give_up" in moves for moves in MODEL_TRANSITIONS.values())


def test_restart_intensity_allows_restart_max_within_the_period_with_a_doubling_backoff():
    assert [intensity.respawn_delay(n, SCFG) for n in range(4)] == [0.5, 1.0, 2.0, None]
    assert intensity.respawn_delay(0, SupervisorConfig(restart_max=0)) is None
    assert intensity.respawn_delay(6, SupervisorConfig(restart_max=10)) == intensity.RESPAWN_MAX


def test_only_restarts_within_the_period_count():
    assert intensity.recent([0.0, 30.0, 59.0], 100.0, SCFG) == [59.0]
    assert intensity.recent([40.0, 41.0], 100.0, SCFG) == [40.0, 41.0]


def test_a_failed_model_is_tried_again_after_a_doubling_backoff_that_starts_over_after_a_quiet_spell():
    failures, delays, last = 0, [], 0.0
    for now in (0.0, 10.0, 30.0, 70.0, 200.0):
        failures, delay = intensity.failure_backoff(failures, last, now, SCFG)
        last = now
        delays.append(delay)
    assert delays == [5.0, 10.0, 20.0, 40.0, 80.0]
    # served for longer than twice the cap since its last failure: the backoff starts over
    assert intensity.failure_backoff(5, 200.0, 400.0, SCFG) == (1, 5.0)
