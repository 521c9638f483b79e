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
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Union

import msgspec

from shared import protocol as p
from shared.ledger import LedgerSample
from shared.limits import Limits
from shared.memory import NO_READING
from shared.states import LIVE_STATES, SERVING_STATES, WorkerState, WorkerTrigger, transition
from shared.vocab import LeaveCause, PoolName, StopCause, WorkerEventKind
from supervisor.cache_tiers import save_grace
from supervisor.errors import LoadError
from supervisor.liveness import Beats
from supervisor.views import WorkerView

if TYPE_CHECKING:
    from pathlib import Path

    import multiprocess.process

    from supervisor.bus import Endpoints
    from supervisor.config import Config, ModelConfig
    from supervisor.load_clock import LoadClock



class Leaving(msgspec.Struct, frozen=True):
    """Why a worker is on its way out, one value instead of four flags (mark, stopping, cause, reason).

    Set when P6.3 marks the worker (or its load failed: `cause` "marked") or when its stop
    begins (the stop's cause); never cleared, since a worker on its way out never comes back.
    `reason`: the stop's words, the status's `stop_reason` ("" while only marked).
    `marked`: the mark came first; `marked_for_unload` keeps saying so while it drains."""

    cause: LeaveCause
    reason: str = ""
    marked: bool = False


class WorkerHandle:
    """The supervisor's view of one worker process.

    A spare (SPEC W1) has no model until a load hands it one (`adopt`): its
    `model_id` is "" and asking for its `model` is a bug."""

    def __init__(self, worker_id: str, model: ModelConfig | None, slot: int, generation: int) -> None:
        self.worker_id = worker_id
        self.identity = worker_id.encode()
        self._model = model
        self.model_id: str = model.id if model is not None else ""
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
        # its hello came (True), or it exited first (False): what a load waiting for a starting spare awaits
        self.greeted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.leaving: Leaving | None = None  # marked, or its stop begun: why (never cleared)
        self.stopping: asyncio.Task | None = None  # its stop's escalation (Pool.stop), once begun
        self.exit_cause = ""
        self.concurrency = max(1, model.max_concurrency) if model is not None else 1
        self.sample: LedgerSample | None = None
        self.last_limits: Limits | None = None
        self.signals_sent: list[int] = []
        self.load: LoadClock | None = None  # W3, W6: its model's load, timed (None: a spare's wait)

    @property
    def model(self) -> ModelConfig:
        """The model it serves or loads (a spare has none: asking is a bug, said loudly)."""
        if self._model is None:
            raise RuntimeError(f"worker {self.worker_id} is a spare: it has no model yet")
        return self._model

    @model.setter
    def model(self, model: ModelConfig) -> None:
        self._model = model

    @property
    def spare(self) -> bool:
        """SPEC W1: started with no model, waiting for one (or starting to)."""
        return self._model is None

    def adopt(self, model: ModelConfig) -> None:
        """W1's hand-off, on the supervisor's side: the spare becomes `model`'s worker."""
        self._model = model
        self.model_id = model.id
        self.concurrency = max(1, model.max_concurrency)

    @property
    def pinned(self) -> bool:
        return self._model is not None and bool(self._model.pinned)

    @property
    def max_concurrency(self) -> int:
        return self._model.max_concurrency if self._model is not None else 1

    @property
    def ttl(self) -> float | None:
        return self._model.ttl if self._model is not None else None

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES

    @property
    def marked_for_unload(self) -> bool:
        """P6.3: no new request is routed to it; it is stopped once it is idle."""
        return self.leaving is not None and self.leaving.marked

    def left_because(self, *causes: LeaveCause) -> bool:
        """It is on its way out for one of `causes`."""
        return self.leaving is not None and self.leaving.cause in causes

    def mark(self) -> None:
        """P6.3's mark (or a failed load's): it stays what it is and takes nothing new."""
        self.leaving = (Leaving("marked", marked=True) if self.leaving is None
                        else msgspec.structs.replace(self.leaving, marked=True))

    def stop(self, cause: StopCause, reason: str, escalate: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task:
        """Its stop begins, once: `escalate()` (the pool's drain -> SIGTERM -> SIGKILL) runs as a
        task that every later ask gets back, with the first cause and reason kept."""
        if self.stopping is None:
            self.leaving = Leaving(cause, reason, marked=self.marked_for_unload)
            self.move("stop")
            self.stopping = asyncio.get_running_loop().create_task(escalate())
        return self.stopping

    def view(self, running: int) -> WorkerView:
        """Frozen, for the doors (`running`: the requests the pool's streams map to it)."""
        sample, limits = self.sample, self.last_limits
        return WorkerView(worker_id=self.worker_id, model_id=self.model_id, pid=self.pid, state=self.state,
                          running=running, stop_reason=self.leaving.reason if self.leaving is not None else "",
                          leaving=self.leaving is not None,
                          memory=sample.memory if sample is not None else NO_READING,
                          weight_bytes=self.weight_bytes, cache_cap=limits.cache_cap if limits is not None else 0)

    def ended(self, code: int | None) -> None:
        """Its process is gone (`exit_cause` says how): whoever awaits its load, hello or exit is answered."""
        if self._model is None:
            self.loaded.cancel()  # nothing awaits a spare's load
        elif not self.loaded.done():  # a death, as after loading: 503, retry (not 500: nothing here is our bug)
            self.loaded.set_exception(LoadError(f"worker for {self.model_id!r} {self.exit_cause} before the model "
                                                "was loaded", code="worker_exited", http_status=503))
        if not self.exited.done():
            self.exited.set_result(code)
        if not self.greeted.done():
            self.greeted.set_result(False)

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
        model_id=handle.model_id,  # "" for a spare: it waits for a TakeModel with the rest of this spec
        model_path="" if handle.spare else str(handle.model.path),
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


class SpareNews(_News):
    """W1, W2: a spare was handed a model, or is being stopped (its start is a `Spawned`)."""


@dataclass(frozen=True, slots=True)
class LoadReported:
    """W6: a load's progress (`done` False), or W3: its phases once it is over (`done`)."""

    handle: WorkerHandle
    report: p.LoadReport
    done: bool
    reason: str


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


PoolEvent = Union[Spawned, WorkerLoaded, WorkerLoadFailed, WorkerNeedsMemory, Wedged, Exited, Reported, CacheWritten,
                  SpareNews, LoadReported]
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
