"""The one transition helper behind the worker, model and request tables (shared.state_table)."""

from __future__ import annotations

from typing import Literal, get_args

import pytest

from shared import states
from shared.state_table import IllegalMove, state_machine
from supervisor.models import model_states
from worker import request

Light = Literal["red", "green", "amber"]
Change = Literal["go", "slow", "stop"]


def test_a_table_without_a_row_for_every_state_is_refused_when_built():
    with pytest.raises(ValueError, match=r"no row for \['amber'\]: every state has a row"):
        state_machine("light", {"red": {"go": "green"}, "green": {"slow": "amber"}}, get_args(Light))


def test_a_move_to_a_state_that_does_not_exist_is_refused_when_built():
    with pytest.raises(ValueError, match="'blue'"):
        state_machine("light", {"red": {"go": "blue"}, "green": {}, "amber": {}}, get_args(Light))


def test_an_illegal_move_names_the_thing_the_state_and_the_event():
    move = state_machine("light", {"red": {"go": "green"}, "green": {}, "amber": {}}, get_args(Light))
    assert move("red", "go") == "green"
    with pytest.raises(IllegalMove, match="a light in state 'green' cannot take event 'stop'") as caught:
        move("green", "stop")
    assert (caught.value.thing, caught.value.state, caught.value.event) == ("light", "green", "stop")


@pytest.mark.parametrize("transition, thing, state, event", [
    (states.transition, "worker", "stopped", "hello"),
    (model_states.model_transition, "model", "steady", "retry"),
    (request.transition, "request", "ended", "end"),
])
def test_the_three_tables_refuse_with_the_one_error(transition, thing, state, event):
    with pytest.raises(IllegalMove, match=f"a {thing} in state {state!r}"):
        transition(state, event)
