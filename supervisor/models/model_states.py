"""The model state machine. Everything that changes a model's state is here.

Beside the worker's table (shared.states), in the same manner: a worker is
one process, a model outlives its workers. The pool knows whether a worker
of the model is up and how it is; this table knows what the supervisor is
doing about the model itself:

    steady      nothing in progress (its worker serves, or it is not loaded)
    loading     a load is in flight, shared by every request for it (SPEC A5)
    respawning  its pinned worker exited; a new one starts after a backoff
    failed      restart intensity exhausted, or its files cannot be loaded;
                requests are refused until its next try

    steady     --load-->    loading --done--> steady
    steady | loading --exit--> respawning --load--> loading  (the respawn)
    steady | loading | respawning --give_up--> failed --retry--> steady

A load that ends after its model moved on (its worker exited mid-load, or it
was given up) changes nothing: `done` is absorbed by respawning and failed,
as a late `loaded` is by a draining worker. Any other move is a bug, and
`model_transition` says so loudly (`IllegalMove`, shared/state_table.py).
"""

from __future__ import annotations

from typing import Literal, get_args

from shared.state_table import IllegalMove, state_machine

ModelState = Literal["steady", "loading", "respawning", "failed"]
ModelEvent = Literal["load", "done", "exit", "give_up", "retry"]

MODEL_TRANSITIONS: dict[ModelState, dict[ModelEvent, ModelState]] = {
    "steady": {"load": "loading", "exit": "respawning", "give_up": "failed"},
    "loading": {"done": "steady", "exit": "respawning", "give_up": "failed"},
    "respawning": {"load": "loading", "done": "respawning", "give_up": "failed"},
    "failed": {"retry": "steady", "give_up": "failed", "done": "failed"},
}

__all__ = ["MODEL_TRANSITIONS", "IllegalMove", "ModelEvent", "ModelState", "model_transition"]


model_transition = state_machine("model", MODEL_TRANSITIONS, get_args(ModelState))
"""The state after an event, or IllegalMove (shared.state_table)."""
