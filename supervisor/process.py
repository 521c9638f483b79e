"""One worker process as the supervisor holds it: its handle, its state, its news, how it ended.

A `WorkerHandle` is live state, and only the pool changes it (spawn, the
worker's messages, liveness, stops, exits): everyone else reads it, and the
doors see frozen `WorkerView`s. Its state moves only through the table in
shared.states (`move`), so a late message cannot undo a decision.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Union

from shared import protocol as p
from shared.ledger import LedgerSample
from shared.limits import Limits
from shared.states import LIVE_STATES, SERVING_STATES, WorkerState, WorkerTrigger, transition
from shared.vocab import PoolName, WorkerEventKind
from supervisor.cache_tiers import save_grace
from supervisor.liveness import Beats

if TYPE_CHECKING:
    from pathlib import Path

    import multiprocess.process

    from supervisor.bus import Endpoints
    from supervisor.config import Config, ModelConfig

# Why a stop was asked for; a pinned model whose load the
# guard aborted (P6 step 4), or that was killed as wedged, comes back as after a crash.
StopCause = Literal["request", "evict", "ttl", "unload", "load_abort", "wedged", "shutdown"]


class WorkerHandle:
    """The supervisor's view of one worker process."""

    def __init__(self, worker_id: str, model: ModelConfig, slot: int, generation: int) -> None:
        self.worker_id = worker_id
        self.identity = worker_id.encode()
        self.model = model
        self.model_id: str = model.id
        self.slot = slot
        self.generation = generation
        self.proc: multiprocess.process.BaseProcess | None = None
        self.pid: int = 0
        self.state: WorkerState = "starting"
        now = time.monotonic()
        self.beats = Beats(spawned_at=now, last_pong=now)  # supervisor.liveness reads them
        self.last_access = now
        self.ping_seq = 0
        self.weight_bytes = 0
        self.device_info: dict = {}
        self.loaded: asyncio.Future = asyncio.get_running_loop().create_future()
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self.marked_for_unload = False
        self.stop_reason = ""
        self.stop_cause: StopCause | None = None
        self.stopping: asyncio.Task | None = None
        self.exit_cause = ""
        self.concurrency = max(1, model.max_concurrency)
        self.sample: LedgerSample | None = None
        self.last_limits: Limits | None = None
        self.signals_sent: list[int] = []

    @property
    def pinned(self) -> bool:
        return bool(self.model.pinned)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES

    def move(self, event: WorkerTrigger) -> WorkerState:
        """The one place a worker's state changes (illegal moves raise)."""
        self.state = transition(self.state, event)
        return self.state

    def __repr__(self) -> str:
        return f"<worker {self.worker_id} pid={self.pid} {self.state}>"


def worker_spec(handle: WorkerHandle, config: Config, ledger_path: Path, endpoints: Endpoints) -> p.WorkerSpec:
    """What the new worker process is told: who it is, where to report, its settings."""
    scfg, guard = config.supervisor, config.guard
    return p.WorkerSpec(
        worker_id=handle.worker_id,
        model_id=handle.model_id,
        model_path=str(handle.model.path),
        slot=handle.slot,
        ledger_path=str(ledger_path),
        commands=endpoints.commands,
        reports=endpoints.reports,
        supervisor_pid=os.getpid(),
        heartbeat_timeout=scfg.heartbeat_timeout,
        max_concurrency=handle.concurrency,
        chunk_seconds=scfg.chunk_seconds,
        prefill_order=scfg.prefill_order,
        draft_path=handle.model.draft,  # the draft's folder (Catalog.loadable made it one)
        allow_drills=scfg.allow_drills,
        # H5: the disk tier keeps what the memory tier held; with no memory tier it has nothing
        disk_cache_max=int(guard.disk_cache_max) if guard.hot_cache_max else 0,
        disk_cache_grace=save_grace(guard),
        cache_quantize_bits=guard.cache_quantize_bits,
    )


# ---------------------------------------------------------------------------
# what the pool tells the others about a worker (`Pool.on_event`)


@dataclass(frozen=True, slots=True)
class _News:
    """Something happened to one worker; `reason` is the words for the event."""

    handle: WorkerHandle
    reason: str


class Spawned(_News):
    """A worker process was started for a model."""


class CacheWritten(_News):
    """H5 (proposed): what the worker wrote to the disk tier, and what its stop's deadline cost."""


class WorkerLoaded(_News):
    """The worker loaded its model and serves."""


class WorkerLoadFailed(_News):
    """The worker could not load its model (it exits next)."""


@dataclass(frozen=True, slots=True)
class WorkerNeedsMemory:
    """SPEC G1: the worker's prefill needs `need_bytes` more (the shortfall) in `pool`."""

    handle: WorkerHandle
    request_id: str
    need_bytes: int
    pool: PoolName = "host"


@dataclass(frozen=True, slots=True)
class Exited:
    """The process is gone; `expected` when a stop had been asked for."""

    handle: WorkerHandle
    reason: str
    expected: bool
    code: int | None


@dataclass(frozen=True, slots=True)
class Wedged:
    """The worker stopped answering (supervisor.liveness says how); it is being killed."""

    handle: WorkerHandle
    reason: str


@dataclass(frozen=True, slots=True)
class Reported:
    """An event the worker itself reported (drills)."""

    handle: WorkerHandle
    kind: WorkerEventKind
    reason: str


PoolEvent = Union[Spawned, WorkerLoaded, WorkerLoadFailed, WorkerNeedsMemory, Wedged, Exited, Reported, CacheWritten]
EventSink = Callable[[PoolEvent], None]


def describe_exit(code: int | None, expected: bool, signals_sent: list[int]) -> str:
    """gunicorn-style cause of a worker's exit, with a hint where one helps."""
    if code is None:
        return "exited (status unknown)"
    if code == 0:
        return "exited cleanly" if expected else "exited without being asked to"
    if code > 0:
        return f"exited with code {code}"
    sig = -code
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig in signals_sent:
        return f"was stopped with {name}"
    if sig == signal.SIGKILL:
        return f"was sent {name}! Perhaps out of memory?"
    return f"was killed by {name}"
