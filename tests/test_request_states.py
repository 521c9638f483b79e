"""One request state table in the engine (worker/request.py), h11-style."""

from __future__ import annotations

from typing import get_args

import pytest

from shared.state_table import IllegalMove
from worker.request import TRANSITIONS, RequestEvent, RequestState, Seq, transition
from worker.sampling import greedy


def test_every_state_but_ended_can_end_and_ended_takes_nothing():
    for state in get_args(RequestState):
        if state == "ended":
            assert TRANSITIONS[state] == {}
        else:
            assert transition(state, "end") == "ended"


@pytest.mark.parametrize(("state", "event"), [("ended", "end"), ("queued", "first_token"),
                                              ("decoding", "start"), ("prefill", "group"),
                                              ("waiting", "start")])
def test_an_illegal_move_raises_and_names_the_state_and_event(state, event):
    with pytest.raises(IllegalMove, match=f"{state!r} cannot take event {event!r}"):
        transition(state, event)


def test_one_request_through_grouped_prefill_split_and_decode():
    seq = Seq("r", [1, 2, 3], 4, greedy, None)
    events: list[RequestEvent] = ["admit", "group", "split", "first_token", "end"]
    seen = [seq.state]
    for event in events:
        seq.move(event)
        seen.append(seq.state)
    assert seen == ["queued", "preflight", "grouped", "prefill", "decoding", "ended"]
    with pytest.raises(IllegalMove):
        seq.move("end")  # a second terminal event


def test_g2_a_prefill_held_for_room_goes_back_to_prefill_and_asks_no_more():
    """G2 (2026-12-05): the floor chunk's request for room keeps the request's KV: `held`, then
    back to `prefill`, not to G1's preflight (which would start its KV over)."""
    seq = Seq("r", [1, 2, 3], 4, greedy, None)
    for event in ("admit", "start", "need_memory"):
        seq.move(event)  # type: ignore[arg-type]
    assert seq.state == "held"
    seq.retry_after_room()
    assert (seq.state, seq.floor_retried, seq.retried) == ("prefill", True, False)
