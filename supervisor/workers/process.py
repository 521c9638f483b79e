"""One worker process as the supervisor holds it: its handle, its state, its news, how it ended.

A `WorkerHandle` is live state, and it changes only through its own methods,
as h11's `ConnectionState` changes only through `process_event`: each says
what happened to the worker (it said hello, loaded, was sampled, was asked to
stop, exited) and updates what that fact touches, so no caller sets a field
and forgets its neighbour (tests/test_worker_handle.py holds every other
module to it). The pool, the message router, the spares, the enforcer and the
models call them; the doors see frozen `WorkerView`s. Its state moves only
through the table in shared.states (`move`), so a late message cannot undo a
decision; why it leaves is one `Leaving` value.
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
from shared.states import LIVE_STATES, LOADING_STATES, SERVING_STATES, WorkerState, WorkerTrigger, transition
from shared.vocab import LeaveCause, PoolName, StopCause, WorkerEventKind
from supervisor.doors.refusals import LoadError
from supervisor.doors.views import WorkerView
from supervisor.guard.cache_book import save_grace
from supervisor.workers import liveness, load_clock

if TYPE_CHECKING:
    from pathlib import Path

    import multiprocess.process

    from supervisor.config import Config, ModelConfig
    from supervisor.wiring.bus import Endpoints
    from supervisor.workers.load_clock import LoadClock



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
        self.beats = liveness.Beats(spawned_at=now, last_pong=now)  # supervisor.workers.liveness reads them
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

    @property
    def spare(self) -> bool:
        """SPEC W1: started with no model, waiting for one (or starting to)."""
        return self._model is None


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

    # -- what happened to the worker: the one place its fields change ----------------------

    def started(self, proc: multiprocess.process.BaseProcess, load: LoadClock | None) -> None:
        """Its process runs; `load`: its model's load, timed (None: a spare, whose wait is not a load)."""
        self.proc, self.pid, self.load = proc, proc.pid or 0, load

    def said_hello(self, hello: p.Hello, now: float) -> None:
        """Its process runs our code: it loads (a spare waits for a model); whoever awaits that
        is answered. D1: a worker whose arrays live on the CPU holds nothing on the accelerator
        its MLX can see (an empty `device` is an older worker: trust its info)."""
        self.device_info = {} if hello.device.startswith("Device(cpu") else dict(hello.device_info)
        self.move("wait" if hello.spare else "hello")
        self.beats.last_pong = now
        if self.load is not None:  # W3: the process's start and its imports, timed
            load_clock.hello(self.load, hello.started, now)
        if not self.greeted.done():
            self.greeted.set_result(True)

    def set_device_info(self, info: dict) -> None:
        """D1: the accelerator its MLX sees (its hello's; drills and tests pretend one)."""
        self.device_info = info

    def adopt(self, model: ModelConfig, load: LoadClock, now: float) -> None:
        """W1's hand-off, on the supervisor's side: the spare becomes `model`'s worker and loads
        it from now on (its load timeout counts from here, supervisor.workers.liveness.handed_off)."""
        self._model = model
        self.model_id = model.id
        self.concurrency = max(1, model.max_concurrency)
        self.move("take")
        self.beats = liveness.handed_off(self.beats, now)
        self.load = load

    def has_loaded(self, weight_bytes: int, now: float) -> None:
        """Its model is loaded (a worker on its way out stays draining: a stop is final)."""
        self.weight_bytes = weight_bytes
        self.move("loaded")
        self.last_access = self.beats.last_pong = now
        if not self.loaded.done():
            self.loaded.set_result(True)

    def load_failed(self, error: str) -> None:
        """Its files are unusable: retrying will not help (a permanent error); it exits next."""
        if not self.loaded.done():
            self.loaded.set_exception(LoadError(f"model {self.model_id!r} failed to load: {error}",
                                                http_status=503, permanent=True))
        self.mark()

    def used(self, now: float) -> None:
        """A request opened or ended, or a tokenizer call went out: its idle time (P10) starts again."""
        self.last_access = now

    def next_ping(self) -> int:
        """The sequence number of the ping about to be sent (its pong names it)."""
        self.ping_seq += 1
        return self.ping_seq

    def ponged(self, now: float) -> None:
        """Its step loop answered a ping."""
        self.beats.last_pong = now

    def heard(self, alive: p.Alive, now: float) -> None:
        """Its heartbeat thread reported, with how long the engine step in progress has run."""
        self.beats.last_alive = now
        self.beats.alive = alive

    def forgive(self, now: float, stalled: float) -> None:
        """The supervisor's loop stalled: no silence over that time counts (supervisor.workers.liveness)."""
        self.beats = liveness.forgiven(self.beats, now, stalled, self.state in LOADING_STATES)

    def sampled(self, sample: LedgerSample, busy: bool) -> None:
        """Its ledger slot's latest reading; a serving worker is busy or idle by it."""
        self.sample = sample
        if self.serving:
            self.move("work" if busy else "idle")

    def limits_sent(self, limits: Limits) -> None:
        """The limits it was last sent (sent again after its hello; the view's cache share)."""
        self.last_limits = limits

    def set_concurrency(self, cap: int) -> None:
        """P8: its request slots."""
        self.concurrency = cap

    def keep_alive(self, seconds: float) -> None:
        """A request's keep_alive: its own copy of its model's config carries the TTL P10
        reads, so it lasts until this worker stops."""
        self._model = msgspec.structs.replace(self.model, ttl=seconds)

    def reconfigure(self, model: ModelConfig) -> None:
        """A reload changed the model in place: pinned and ttl are read from it; P8 walks
        the concurrency toward the new maximum."""
        self._model = model
        self.concurrency = min(self.concurrency, model.max_concurrency)

    def signalled(self, sig: int) -> None:
        """A signal was sent to it (an exit by that signal was asked for, describe_exit)."""
        self.signals_sent.append(sig)

    def ended(self, code: int | None) -> None:
        """Its process is gone: `exit_cause` says how, in words, and whoever awaits its load,
        hello or exit is answered."""
        self.exit_cause = describe_exit(code, self.stopping is not None, self.signals_sent)
        self.move("exit")
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
        draft_path="" if handle.spare else handle.model.draft,  # the draft's folder (Catalog.loadable made it one)
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
    """The worker stopped answering (supervisor.workers.liveness says how); it is being killed."""

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
