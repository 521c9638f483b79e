"""What the doors are shown of a model and of a worker: frozen copies, never the handles.

The pool's `WorkerHandle` is live state that only the pool changes; a door
(HTTP, the control socket, the metrics) that held one could read it half
way through a change or be tempted to set it. It gets these instead, made
at the moment it asks.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.memory import NO_READING, MemoryReading
from shared.states import LIVE_STATES, SERVING_STATES, WorkerState
from shared.vocab import LoadPhase


class ModelView(msgspec.Struct, frozen=True, kw_only=True):
    """A model's state, worked out in one place (`Models.view`).

    `state` is its live worker's state, else `failed` (restart intensity
    exhausted: `reason` says why), else `unloaded`."""

    id: str
    state: str
    worker: str = ""
    pid: int = 0
    reason: str = ""
    retry_in: float = -1.0  # failed: seconds until the next try (-1: none scheduled)


class WorkerView(msgspec.Struct, frozen=True, kw_only=True):
    """One worker process as it stands (`Pool.view`).

    `running`: requests it serves now. `leaving`: marked for unload or
    stopping, so the next request for its model loads a fresh one
    (`stop_reason` says why). `cache_cap`: its share of the prompt cache's
    budget, from the limits it was last sent."""

    worker_id: str
    model_id: str
    pid: int
    state: WorkerState
    running: int = 0
    leaving: bool = False
    stop_reason: str = ""
    memory: MemoryReading = NO_READING
    weight_bytes: int = 0
    cache_cap: int = 0

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES


class LoadProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far a model's load has come.

    `state`: `queued` (no worker yet: waiting for the one-load-at-a-time
    lock, admission's evictions, its files being read or imported),
    `starting` (the process is importing MLX), `loading` (reading weights).
    `phase` (SPEC W6): the load's phase in progress, finer (`admit`, `spawn`,
    `hello`, `spare`, `build`, `read`, `tokenizer`, `warm_up`; see
    shared.vocab.LoadPhase). `bytes`: what the worker has taken since it
    started loading (its footprint less the one it reported before the
    weights), against `estimate_bytes`, A2's weight estimate (0: not known
    yet). `bytes_read` (W6): the weights the worker has read so far, as it
    counts them (0 where its platform cannot). `eta`: seconds left at the
    rate so far (None until a tenth of it is in), from the bytes read when
    they are counted, else from `bytes`."""

    state: str
    bytes: int
    estimate_bytes: int
    elapsed: float
    eta: float | None = None
    phase: LoadPhase | Literal[""] = ""
    bytes_read: int = 0
