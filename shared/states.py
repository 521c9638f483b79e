"""The worker state machine. Everything that changes a worker's state is here.

In the manner of h11's `_state.py`: the states, the triggers that move them and
the legal moves as one table, and one `transition()` that refuses an illegal
move loudly (`IllegalMove`, shared/state_table.py) instead of letting a late message undo a
decision. The supervisor's pool keeps each worker's state with it; the
policy's snapshot, the ledger's phases (shared.vocab.WorkerPhase) and the status all use these
names.

    starting --hello--> loading --loaded--> ready <--work/idle--> busy
    starting --wait--> spare --take--> loading      (SPEC W1: a spare worker, then its model)
        any live state --stop--> draining --exit--> stopped
        any live state --silent--> wedged (missed heartbeats or load timeout)
        a live state that was not stopping --exit--> dead

A model outlives its workers: whether it is failed, respawning or loading is
the model's state (supervisor/models/model_states.py), not its last worker's.

Late messages are absorbed, not applied: a `hello` or `loaded` from a worker
already draining leaves it draining (a stop is final), and a wedged worker
stays wedged while it is killed, so `status` says why it went.

A spare (SPEC W1) is a worker started with MLX and the engine imported and no
model: its hello says so (`wait`), and a load hands it a model (`take`), after
which it loads like any worker. It serves no request while it waits.

Public names (stable): WorkerState, WorkerTrigger, TRANSITIONS, transition,
IllegalMove, LIVE_STATES, SERVING_STATES, LOADING_STATES, GONE_STATES.
(The phases a worker writes into its ledger slot: shared.vocab.WorkerPhase.)
"""

from __future__ import annotations

from typing import Literal, get_args

from shared.state_table import IllegalMove, state_machine

WorkerState = Literal["starting", "loading", "ready", "busy", "draining", "stopped", "dead", "wedged", "spare"]
WorkerTrigger = Literal["hello", "wait", "take", "loaded", "work", "idle", "stop", "silent", "exit"]

_LIVE_MOVES: dict[WorkerTrigger, WorkerState] = {"stop": "draining", "silent": "wedged", "exit": "dead"}

TRANSITIONS: dict[WorkerState, dict[WorkerTrigger, WorkerState]] = {
    "starting": {"hello": "loading", "wait": "spare", **_LIVE_MOVES},
    # W1: a spare waits with no model until a load hands it one
    "spare": {"take": "loading", **_LIVE_MOVES},
    "loading": {"loaded": "ready", **_LIVE_MOVES},
    "ready": {"work": "busy", "idle": "ready", **_LIVE_MOVES},
    "busy": {"work": "busy", "idle": "ready", **_LIVE_MOVES},
    # A stop is final: late hellos, loads and samples change nothing.
    "draining": {"hello": "draining", "wait": "draining", "loaded": "draining", "work": "draining",
                 "idle": "draining", "stop": "draining", "silent": "draining", "exit": "stopped"},
    # Killed for silence: it stays wedged until it is gone, then it is dead.
    "wedged": {"hello": "wedged", "wait": "wedged", "loaded": "wedged", "work": "wedged", "idle": "wedged",
               "stop": "wedged", "silent": "wedged", "exit": "dead"},
    "stopped": {},  # the process is gone: nothing moves it any more
    "dead": {},
}

__all__ = ["GONE_STATES", "LIVE_STATES", "LOADING_STATES", "SERVING_STATES", "TRANSITIONS", "IllegalMove",
           "WorkerState", "WorkerTrigger", "transition"]

# The process (and the memory it holds) exists.
LIVE_STATES: frozenset[WorkerState] = frozenset({"starting", "loading", "ready", "busy", "draining", "wedged",
                                                 "spare"})
# A model is loaded and takes requests.
SERVING_STATES: frozenset[WorkerState] = frozenset({"ready", "busy"})
# A model load is in progress (P6 step 4, P9).
LOADING_STATES: frozenset[WorkerState] = frozenset({"starting", "loading"})
# The process is gone.
GONE_STATES: frozenset[WorkerState] = frozenset({"stopped", "dead"})


transition = state_machine("worker", TRANSITIONS, get_args(WorkerState))
"""The state after an event, or IllegalMove (shared.state_table)."""
