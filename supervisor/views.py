"""What the doors are shown of a model and of a worker: frozen copies, never the handles.

The pool's `WorkerHandle` is live state that only the pool changes; a door
(HTTP, the control socket, the metrics) that held one could read it half
way through a change or be tempted to set it. It gets these instead, made
at the moment it asks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from shared.memory import NO_READING, MemoryReading
from shared.states import LIVE_STATES, SERVING_STATES, WorkerState

if TYPE_CHECKING:
    from supervisor.process import WorkerHandle


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


def worker_view(handle: WorkerHandle, running: int) -> WorkerView:
    """The handle as it stands, frozen (`running`: the requests the pool's streams map to it)."""
    sample, limits = handle.sample, handle.last_limits
    return WorkerView(worker_id=handle.worker_id, model_id=handle.model_id, pid=handle.pid, state=handle.state,
                      running=running, stop_reason=handle.stop_reason,
                      leaving=handle.marked_for_unload or handle.stopping is not None,
                      memory=sample.memory if sample is not None else NO_READING,
                      weight_bytes=handle.weight_bytes, cache_cap=limits.cache_cap if limits is not None else 0)


class LoadProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far a model's load has come.

    `state`: `queued` (no worker yet: waiting for the one-load-at-a-time
    lock, admission's evictions, its files being read or imported),
    `starting` (the process is importing MLX), `loading` (reading weights).
    `bytes`: what the worker has taken since it started loading (its
    footprint less the one it reported before the weights), against
    `estimate_bytes`, A2's weight estimate (0: not known yet). `eta`:
    seconds left at the rate so far (None until a tenth of it is in)."""

    state: str
    bytes: int
    estimate_bytes: int
    elapsed: float
    eta: float | None = None
