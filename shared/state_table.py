"""One transition table, checked once: the helper behind every state machine here.

Workers (shared/states.py), models (supervisor/models/model_states.py) and requests
(worker/request.py) each keep their states, their events and the legal moves
as one table, in the manner of h11's `_state.py`. What they share is written
here once: the check that every state has a row and that every move lands on
a state (made when the table is built, at import, so a table with a hole never
runs), and the `transition()` that refuses a move the table does not allow
loudly (`IllegalMove`) instead of letting a late message undo a decision.

Public names (stable): IllegalMove, state_machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

State = TypeVar("State", bound=str)
Event = TypeVar("Event", bound=str)


class IllegalMove(RuntimeError):
    """A move the table does not allow: a bug in the caller, said loudly."""

    def __init__(self, thing: str, state: str, event: str) -> None:
        super().__init__(f"a {thing} in state {state!r} cannot take event {event!r}")
        self.thing = thing
        self.state = state
        self.event = event


def state_machine(
    thing: str, table: Mapping[State, Mapping[Event, State]], states: tuple[Any, ...]
) -> Callable[[State, Event], State]:
    """The `transition(state, event)` of `table`, after checking the table.

    `thing` names what moves ("worker", "model", "request") in the error;
    `states` is every state (`typing.get_args` of its Literal). Raises
    ValueError at once when a state has no row (a state nothing can leave
    has an empty one) or a move lands outside `states`.
    """
    known = set(states)
    missing = known - set(table)
    if missing:
        raise ValueError(f"the {thing} table has no row for {sorted(missing)}: every state has a row")
    strays = {target for row in table.values() for target in row.values()} - known
    if strays or set(table) - known:
        raise ValueError(f"the {thing} table names states that are not {thing} states: "
                         f"{sorted(strays | (set(table) - known))}")

    def transition(state: State, event: Event) -> State:
        """The state after `event`, or IllegalMove."""
        try:
            return table[state][event]
        except KeyError:
            raise IllegalMove(thing, state, event) from None

    return transition
