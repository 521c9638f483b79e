"""Worker processes: spawn, watch, stop with escalation, respawn with restart intensity.

One worker process per loaded model. The pool knows processes and their
states (DESIGN.md: starting -> loading -> ready <-> busy -> draining -> stopped,
plus dead, wedged and failed); it decides nothing about memory. The enforcer
and the front door ask it to spawn and stop; it tells them, through
`on_event`, everything that happened, as typed `PoolEvent`s, each with a
cause people can read. A worker's state changes only through
`WorkerHandle.move` (the table in shared.states).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Literal, Union

import msgspec
import multiprocess
import multiprocess.connection  # noqa: F401  (issue 21: Process.join imports it lazily; out of fds that failed)
from typing_extensions import assert_never

from shared import protocol as p
from shared.ledger import Ledger, LedgerSample
from shared.limits import Limits
from shared.states import LIVE_STATES, LOADING_STATES, SERVING_STATES, WorkerState, WorkerTrigger, transition
from shared.vocab import PoolName, WorkerEventKind
from supervisor.cache_tiers import CacheBook, saved_words
from supervisor.errors import LoadError
from supervisor.streams import RequestStream, Streams
from worker.main import run as worker_main  # the spawn target; imports no MLX at module level

log = logging.getLogger("memvisor.pool")

# Why a stop was asked for; the arbiter respawns a pinned model whose load the
# guard aborted (P6 step 4) as it would after a crash.
StopCause = Literal["request", "evict", "ttl", "unload", "load_abort", "wedged", "shutdown"]


# Seconds a new worker process has, beyond the heartbeat window, to start
# Python and report for the first time (issue 16).
STARTUP_GRACE = 10.0


class WorkerHandle:
    """The supervisor's view of one worker process."""

    def __init__(self, worker_id: str, model, slot: int, generation: int) -> None:
        self.worker_id = worker_id
        self.identity = worker_id.encode()
        self.model = model
        self.model_id: str = model.id
        self.slot = slot
        self.generation = generation
        self.proc: multiprocess.process.BaseProcess | None = None
        self.pid: int = 0
        self.state: WorkerState = "starting"
        self.spawned_at = time.monotonic()
        self.last_access = self.spawned_at
        self.last_pong = self.spawned_at
        self.last_alive = 0.0  # when the worker's heartbeat thread last reported (issue 16)
        self.alive: p.Alive | None = None
        self.ping_seq = 0
        self.weight_bytes = 0
        self.device_info: dict = {}
        self.loaded: asyncio.Future = asyncio.get_running_loop().create_future()
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self.requests: dict[str, RequestStream] = {}
        self.marked_for_unload = False
        self.stop_reason = ""
        self.stop_cause: StopCause | None = None
        self.stopping: asyncio.Task | None = None
        self.failed_reason = ""
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
class Reported:
    """An event the worker itself reported (drills)."""

    handle: WorkerHandle
    kind: WorkerEventKind
    reason: str


PoolEvent = Union[Spawned, WorkerLoaded, WorkerLoadFailed, WorkerNeedsMemory, Exited, Reported, CacheWritten]
EventSink = Callable[[PoolEvent], None]


class Retired:
    """Where a model stands when no worker of it could even start (its load was
    refused before a spawn): a dead worker with no process, so that giving up
    on it is the same `give_up` move as for a worker that crashed."""

    __slots__ = ("state", "failed_reason")

    def __init__(self) -> None:
        self.state: WorkerState = "dead"
        self.failed_reason = ""

    def move(self, event: WorkerTrigger) -> WorkerState:
        self.state = transition(self.state, event)
        return self.state


class ModelView(msgspec.Struct, frozen=True, kw_only=True):
    """A model's state, worked out in one place (`Pool.model_view`).

    `state` is its live worker's state, else `failed` (restart intensity
    exhausted: `reason` says why), else `unloaded`."""

    id: str
    state: str
    worker: str = ""
    pid: int = 0
    reason: str = ""
    retry_in: float = -1.0  # failed: seconds until the next try (-1: none scheduled)


class Pool:
    def __init__(self, *, bus, ledger: Ledger, config, on_event: EventSink, on_change: Callable[[], None]) -> None:
        self.bus = bus
        self.ledger = ledger
        self.config = config
        self.on_event = on_event
        self.on_change = on_change  # wake the enforcer
        self.handles: dict[str, WorkerHandle] = {}
        self.by_identity: dict[bytes, WorkerHandle] = {}
        self.streams = Streams()
        self.restarts: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        # model id -> its last worker that exited (or a Retired stand-in)
        self.last_exited: dict[str, WorkerHandle | Retired] = {}
        self.retry_at: dict[str, float] = {}  # failed model id -> monotonic time of its next try
        self.failures: dict[str, tuple[int, float]] = {}  # model id -> (times failed in a row, last time)
        self._generation = 0
        self._cmd = 0
        self._free_slots = list(range(ledger.n_slots))
        self._mp = multiprocess.get_context("spawn")
        self.counters: collections.Counter[str] = collections.Counter()
        self._pings: dict[tuple[str, int], asyncio.Future] = {}
        # issue 23: Tokenize/Detokenize waiting for their one reply, by request id
        self._calls: dict[str, tuple[WorkerHandle, asyncio.Future[p.TokensReply]]] = {}
        # Off only in the reaction benchmark's baseline (the seed's fixed 1 s poll).
        self.wake_on_watermark = True
        self.caches = CacheBook()  # each model's prompt-cache disk tier, as its workers report it (H5)

    # -- lookups ------------------------------------------------------------

    def worker_for(self, model_id: str) -> WorkerHandle | None:
        """The live worker serving `model_id` (at most one)."""
        for h in self.handles.values():
            if h.model_id == model_id and h.live:
                return h
        return None

    @property
    def failed(self) -> dict[str, str]:
        """Models whose last worker is in state `failed`, with why."""
        return {m: h.failed_reason for m, h in self.last_exited.items() if h.state == "failed"}

    def mark_failed(self, model_id: str, reason: str, now: float) -> float:
        """Restart intensity exhausted: the model's last worker moves to `failed`
        until a retry after a backoff that doubles up to `failed_retry_max`
        (issue 16: a failed model stayed failed for ever). Returns the delay."""
        scfg = self.config.supervisor
        last = self.last_exited.setdefault(model_id, Retired())
        last.move("give_up")
        last.failed_reason = reason
        count, since = self.failures.get(model_id, (0, now))
        if now - since > 2 * scfg.failed_retry_max:
            count = 0  # it served long enough since its last failure: start the backoff over
        delay = min(scfg.failed_retry_max, scfg.failed_retry_first * 2.0 ** count)
        self.failures[model_id] = (count + 1, now)
        self.retry_at[model_id] = now + delay
        return delay

    def retry(self, model_id: str) -> bool:
        """failed --retry--> stopped: the model may be started again, with a fresh
        restart history. False when it was not failed."""
        last = self.last_exited.get(model_id)
        if last is None or last.state != "failed":
            return False
        last.move("retry")
        self.retry_at.pop(model_id, None)
        self.restarts[model_id].clear()
        return True

    def retry_in(self, model_id: str, now: float) -> float | None:
        """Seconds until a failed model's next try, or None when it is not failed."""
        due = self.retry_at.get(model_id)
        return None if due is None else max(0.0, due - now)

    def model_view(self, model_id: str) -> ModelView:
        handle = self.worker_for(model_id)
        if handle is not None:
            return ModelView(id=model_id, state=handle.state, worker=handle.worker_id, pid=handle.pid)
        last = self.last_exited.get(model_id)
        if last is not None and last.state == "failed":
            retry = self.retry_in(model_id, time.monotonic())
            after = f"; next try in {retry:.0f} s (or at once on an explicit load)" if retry is not None else ""
            return ModelView(id=model_id, state="failed", reason=last.failed_reason + after,
                             retry_in=retry if retry is not None else -1.0)
        return ModelView(id=model_id, state="unloaded")

    # -- spawning -------------------------------------------------------------

    def spawn(self, model) -> WorkerHandle:
        if not self._free_slots:
            raise LoadError(f"no free ledger slot for {model.id!r} (all {self.ledger.n_slots} in use)",
                            code="too_many_workers", http_status=503)
        self._generation += 1
        slot = self._free_slots.pop(0)
        worker_id = f"{model.id}#{self._generation}"
        handle = WorkerHandle(worker_id, model, slot, self._generation)
        scfg = self.config.supervisor
        spec = p.WorkerSpec(
            worker_id=worker_id,
            model_id=model.id,
            model_path=str(model.path),
            slot=slot,
            ledger_path=str(self.ledger.path),
            commands=self.bus.endpoints.commands,
            reports=self.bus.endpoints.reports,
            supervisor_pid=os.getpid(),
            heartbeat_timeout=scfg.heartbeat_timeout,
            max_concurrency=handle.concurrency,
            chunk_seconds=scfg.chunk_seconds,
            allow_drills=scfg.allow_drills,
            # H5: the disk tier keeps what the memory tier held; with no memory tier it has nothing
            disk_cache_max=int(self.config.guard.disk_cache_max) if self.config.guard.hot_cache_max else 0,
            disk_cache_grace=self.save_grace(),
            cache_quantize_bits=self.config.guard.cache_quantize_bits,
        )
        proc = self._mp.Process(
            target=worker_main, args=(msgspec.msgpack.encode(spec),), name=f"memvisor-{worker_id}", daemon=False
        )
        try:
            proc.start()
        except OSError as exc:  # no descriptors or memory left for a process: the OS said no
            self._free_slots.append(slot)
            log.error("Could not start a worker for model %s: %s", model.id, exc)
            raise LoadError(f"could not start a worker process for {model.id!r}: {exc}", code="spawn_failed",
                            http_status=503) from None
        handle.proc = proc
        handle.pid = proc.pid
        self.handles[worker_id] = handle
        self.by_identity[handle.identity] = handle
        asyncio.get_running_loop().add_reader(proc.sentinel, self._on_sentinel, handle)
        self.counters["spawned"] += 1
        log.info("Spawned worker %s (pid %d) for model %s from %s", worker_id, proc.pid, model.id, model.path)
        self.on_event(Spawned(handle, f"started worker pid {proc.pid} to load {model.path}"))
        return handle

    # -- messages from workers ----------------------------------------------

    def on_reply(self, identity: bytes, msg: p.WorkerReply) -> None:
        handle = self.by_identity.get(identity)
        if handle is None or not handle.live:
            self.bus.bad("commands", "unknown_peer", "message from an unknown or stopped worker")
            return
        match msg:
            case p.Tokenized() | p.Detokenized():  # issue 23: a tokenizer call's answer
                self._answer(msg)
            case p.Failed() if msg.request_id in self._calls:  # ... or its refusal
                self._answer(msg)
            case p.TokenOut() | p.Finished() | p.Failed() | p.Prompted() | p.Embedded():  # Prompted: issue 23
                self.streams.deliver(msg)
            case p.TokenBatch():  # issue 11: one decode step's tokens for several requests
                if msg.well_formed():
                    self.streams.deliver_batch(msg)
                else:
                    self.bus.bad("commands", "invalid_message", "token batch with columns of unequal length")
            case p.Pong():
                handle.last_pong = time.monotonic()
                waiter = self._pings.pop((handle.worker_id, msg.seq), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(handle.last_pong)
            case p.Hello():
                self._on_hello(handle, msg)
            case p.Loaded():
                self._on_loaded(handle, msg)
            case p.LoadFailed():
                if not handle.loaded.done():  # the files are unusable: retrying will not help
                    handle.loaded.set_exception(LoadError(f"model {handle.model_id!r} failed to load: {msg.error}",
                                                          http_status=503, permanent=True))
                handle.marked_for_unload = True
                self.on_event(WorkerLoadFailed(handle, msg.error))
            case p.NeedMemory():
                self.on_event(WorkerNeedsMemory(handle, msg.request_id, msg.need_bytes, msg.pool))
            case p.Ack() | p.Reclaimed():
                pass  # informational; the sample that follows carries the effect
            case _:
                assert_never(msg)

    def _on_hello(self, handle: WorkerHandle, msg: p.Hello) -> None:
        if msg.pid != handle.pid or msg.worker_id != handle.worker_id:
            self.bus.bad("commands", "hello_mismatch", "hello that does not match the spawned process")
            return
        # D1: a worker whose arrays live on the CPU holds nothing on the accelerator
        # its MLX can see (an empty `device` is an older worker: trust its info)
        on_cpu = msg.device.startswith("Device(cpu")
        handle.device_info = {} if on_cpu else dict(msg.device_info)
        log.info("Worker %s (%s) runs on %s %s", handle.worker_id, handle.model_id, msg.device or "an unnamed device",
                 msg.device_info.get("device_name", ""))
        handle.move("hello")
        handle.last_pong = time.monotonic()
        if handle.last_limits is not None:
            self.command(handle, p.SetLimits(limits=handle.last_limits))
        self.on_change()

    def _on_loaded(self, handle: WorkerHandle, msg: p.Loaded) -> None:
        handle.weight_bytes = msg.weight_bytes
        handle.move("loaded")  # a worker on its way out stays draining: a stop is final
        handle.last_access = time.monotonic()
        handle.last_pong = handle.last_access
        if not handle.loaded.done():
            handle.loaded.set_result(True)
        log.info("Worker %s loaded %s (%.1f MB weights) in %.2f s",
                 handle.worker_id, handle.model_id, msg.weight_bytes / 1e6, msg.seconds)
        self.on_event(WorkerLoaded(handle, f"model loaded in {msg.seconds:.2f} s"))
        self.on_change()

    def on_report(self, msg: p.WorkerReport) -> None:
        match msg:
            case p.Sample():
                handle = self.handles.get(msg.worker_id)
                if handle is None or msg.pid != handle.pid:
                    self.bus.bad("reports", "unknown_peer", "sample from an unknown worker")
                    return
                self.counters["samples"] += 1
                self.bus.publish(msg)
                if msg.why in ("watermark", "shrink") and self.wake_on_watermark:
                    # P9: a watermark crossing is answered now, not at the next tick; H3: so is a shrink
                    self.on_change()
            case p.WorkerEvent():
                handle = self.handles.get(msg.worker_id)
                if handle is not None:
                    self.on_event(Reported(handle, msg.kind, msg.message))
            case p.Alive():
                handle = self.handles.get(msg.worker_id)
                if handle is None or msg.pid != handle.pid:
                    return  # the last word of a worker that has just exited: it changes nothing
                handle.last_alive = time.monotonic()
                handle.alive = msg
            case p.CacheReport():
                self._on_cache_report(msg)
            case _:
                assert_never(msg)

    def _on_cache_report(self, msg: p.CacheReport) -> None:
        """H5: a worker's disk-tier figures; the last one comes as it exits, maybe after its reaping."""
        handle = self.handles.get(msg.worker_id)
        if handle is None:
            last = self.last_exited.get(msg.model_id)
            handle = last if isinstance(last, WorkerHandle) and last.worker_id == msg.worker_id else None
        if handle is None or handle.pid != msg.pid or handle.model_id != msg.model_id:
            self.bus.bad("reports", "cache report from an unknown worker", cause="unknown_peer")
            return
        self.caches.take(msg)
        s = msg.stats
        if msg.final and (s.written_entries or s.dropped_entries):
            self.counters["disk_cache_saves"] += 1
            self.on_event(CacheWritten(handle, saved_words(s)))

    # -- commands -------------------------------------------------------------

    def command(self, handle: WorkerHandle, msg: p.Command) -> bool:
        self._cmd += 1
        msg.cmd = self._cmd
        if isinstance(msg, p.SetLimits):
            handle.last_limits = msg.limits
        ok = self.bus.send_command(handle.identity, msg)
        if not ok:
            log.debug("command %s to %s not delivered (not connected yet)", type(msg).__name__, handle.worker_id)
        return ok

    def set_limits(self, handle: WorkerHandle, limits: Limits) -> None:
        """Limits go to the ledger (read before every prefill chunk) and as a command."""
        self.ledger.write_limits(handle.slot, limits)
        if limits != handle.last_limits:
            self.command(handle, p.SetLimits(limits=limits))

    def open_request(self, handle: WorkerHandle, request_id: str) -> RequestStream:
        return self.streams.open(handle, request_id)

    def cancel_request(self, stream: RequestStream, reason: str) -> None:
        """The client went away: abort in the worker, forget the stream."""
        if not stream.done:
            self.command(stream.worker, p.AbortRequests(request_ids=[stream.request_id], reason=reason,
                                                        code="client_disconnected"))
            stream.done = True
        self.streams.close(stream)

    # -- liveness ---------------------------------------------------------------

    def heartbeat(self, now: float) -> list[WorkerHandle]:
        """Ping every serving worker; return those silent past the timeout (wedged).

        A worker busy loading weights cannot answer (the load blocks its loop),
        so until it has loaded it gets the much longer load timeout instead.
        A draining worker is left to its stop's own escalation.
        """
        scfg = self.config.supervisor
        wedged = []
        for h in list(self.handles.values()):
            if h.state in LOADING_STATES and h.stopping is None:
                if now - h.spawned_at > scfg.load_timeout or self.silent_while_loading(h, now):
                    wedged.append(h)
                continue
            if not h.serving:
                continue
            if now - h.last_pong > scfg.heartbeat_timeout and not self.in_long_step(h, now):
                wedged.append(h)
                continue
            h.ping_seq += 1
            self.command(h, p.Ping(seq=h.ping_seq))
        return wedged

    def forgive(self, now: float, stalled: float) -> None:
        """Issue 21: the supervisor's own loop could not run for `stalled` seconds,
        so no worker's silence over that time is evidence (its heartbeats may be
        sitting in the socket unread). Every worker gets a fresh window from
        `now`; a loading one's load timeout is pushed back by the stall."""
        for h in self.handles.values():
            h.last_pong = max(h.last_pong, now)
            if h.last_alive:
                h.last_alive = max(h.last_alive, now)
            if h.state in LOADING_STATES:
                h.spawned_at += stalled

    def step_seconds(self, handle: WorkerHandle, now: float) -> float:
        """How long the worker's current engine step has run, by its heartbeat
        thread's last report (0 when it is between steps or the report is stale)."""
        alive = handle.alive
        if alive is None or alive.step_seconds <= 0 or now - handle.last_alive > self.config.supervisor.heartbeat_timeout:
            return 0.0
        return alive.step_seconds + (now - handle.last_alive)

    def silent_while_loading(self, handle: WorkerHandle, now: float) -> bool:
        """Issue 16: a loading worker's heartbeat thread runs from before its
        Hello; once it has reported, silence past the heartbeat window means the
        process is stopped or stuck (a SIGSTOP while loading waited out the
        whole load_timeout, and every client waiting for the load with it)."""
        window = self.config.supervisor.heartbeat_timeout
        if handle.last_alive == 0:  # not a word yet: the interpreter and its imports get a grace
            return now - handle.spawned_at > window + STARTUP_GRACE
        return now - handle.last_alive > window

    def in_long_step(self, handle: WorkerHandle, now: float) -> bool:
        """Issue 16: silent on its command socket, yet provably alive: its
        heartbeat thread reported within the window that the loop is inside
        one engine step (MLX computing), for less than step_timeout. A
        SIGSTOPped worker sends nothing; a loop stuck between steps says so."""
        step = self.step_seconds(handle, now)
        return 0 < step < self.config.supervisor.step_timeout

    async def ping(self, handle: WorkerHandle, timeout: float = 5.0) -> float:
        """Round trip of one command to the worker's step loop and back, in seconds."""
        handle.ping_seq += 1
        key = (handle.worker_id, handle.ping_seq)
        waiter = asyncio.get_running_loop().create_future()
        self._pings[key] = waiter
        sent = time.monotonic()
        self.command(handle, p.Ping(seq=handle.ping_seq))
        try:
            return await asyncio.wait_for(waiter, timeout) - sent
        finally:
            self._pings.pop(key, None)

    async def call(self, handle: WorkerHandle, cmd: p.Tokenize | p.Detokenize, timeout: float) -> p.TokensReply:
        """Issue 23: a command the worker answers with one reply of the same request id
        (or a `Failed`); LoadError 503 when the worker cannot be reached or exits first,
        TimeoutError when it does not answer in `timeout` seconds."""
        waiter: asyncio.Future[p.TokensReply] = asyncio.get_running_loop().create_future()
        self._calls[cmd.request_id] = (handle, waiter)
        try:
            if not self.command(handle, cmd):
                raise LoadError(f"the worker for {handle.model_id!r} is not reachable", code="worker_exited",
                                http_status=503)
            handle.last_access = time.monotonic()  # a use of the model: its idle timer starts again
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._calls.pop(cmd.request_id, None)

    def _answer(self, msg: p.TokensReply) -> None:
        entry = self._calls.pop(msg.request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(msg)

    def _fail_calls(self, handle: WorkerHandle) -> None:
        for request_id, (owner, waiter) in list(self._calls.items()):
            if owner is handle and not waiter.done():
                waiter.set_exception(LoadError(f"the worker serving {handle.model_id!r} {handle.exit_cause}",
                                               code="worker_exited", http_status=503))
                self._calls.pop(request_id, None)

    def read_samples(self) -> None:
        for h in self.handles.values():
            if h.live:
                sample = self.ledger.read_sample(h.slot)
                if sample is not None and sample.pid == h.pid:
                    h.sample = sample
                    if h.serving:
                        h.move("work" if sample.running or h.requests else "idle")

    # -- stopping -------------------------------------------------------------

    def stop(self, handle: WorkerHandle, reason: str, *, kill_now: bool = False,
             cause: StopCause = "request") -> asyncio.Task:
        """Drain -> SIGTERM -> SIGKILL, each after a grace period. Idempotent."""
        if handle.stopping is not None:
            return handle.stopping
        handle.stop_reason = reason
        handle.stop_cause = cause
        handle.move("stop")
        handle.stopping = asyncio.get_running_loop().create_task(self._stop(handle, reason, kill_now))
        return handle.stopping

    async def _stop(self, handle: WorkerHandle, reason: str, kill_now: bool) -> None:
        grace = self.config.supervisor.stop_grace
        # H5: drained, the worker may write its prompt cache to disk for `save` seconds (its own
        # deadline); the escalation waits that much longer and no more before SIGTERM.
        save = self.save_grace()
        if not kill_now and self.command(handle, p.Drain(reason=reason, save_seconds=save)):
            if await self._wait_exit(handle, grace + save):
                return
            log.warning("Worker %s did not exit %.1f s after drain (%.1f s of it to write its prompt cache); "
                        "sending SIGTERM", handle.worker_id, grace + save, save)
        self._signal(handle, signal.SIGTERM)
        if await self._wait_exit(handle, min(grace, 5.0)):
            return
        # A hard kill is the last resort: on macOS it can strand wired Metal memory.
        log.error("Worker %s ignored SIGTERM; sending SIGKILL", handle.worker_id)
        self._signal(handle, signal.SIGKILL)
        await self._wait_exit(handle, None)

    async def _wait_exit(self, handle: WorkerHandle, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(handle.exited), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _signal(self, handle: WorkerHandle, sig: int) -> None:
        handle.signals_sent.append(sig)
        try:
            os.kill(handle.pid, sig)
        except ProcessLookupError:
            pass

    def save_grace(self) -> float:
        """H5: seconds a drained worker may spend writing its prompt cache (0: the disk tier is off)."""
        g = self.config.guard
        return g.disk_cache_grace if g.disk_cache_max and g.hot_cache_max else 0.0

    def kill(self, handle: WorkerHandle, reason: str, cause: StopCause = "request") -> asyncio.Task:
        """For a wedged worker (it will not obey a drain) or a second ^C (no time
        to wait for one): skip straight to signals. A stop already waiting for
        the worker to drain is hurried with SIGTERM; its escalation goes on."""
        if handle.stopping is not None and signal.SIGTERM not in handle.signals_sent:
            self._signal(handle, signal.SIGTERM)
        return self.stop(handle, reason, kill_now=True, cause=cause)

    # -- exits ----------------------------------------------------------------

    def _on_sentinel(self, handle: WorkerHandle) -> None:
        assert handle.proc is not None
        asyncio.get_running_loop().remove_reader(handle.proc.sentinel)
        self._reap(handle, 0)

    def _reap(self, handle: WorkerHandle, tries: int) -> None:
        """The sentinel fires as the child closes its pipe, a moment before the
        kernel has its exit status; poll briefly rather than block the loop."""
        proc = handle.proc
        assert proc is not None
        try:
            proc.join(0)
        except OSError as exc:  # out of descriptors (issue 21): keep trying, never lose the exit
            if tries % 200 == 0:
                log.warning("Reaping worker %s (pid %d) failed: %s; trying again", handle.worker_id, handle.pid, exc)
            asyncio.get_running_loop().call_later(0.05, self._reap, handle, tries + 1)
            return
        if proc.exitcode is None and tries < 200:
            asyncio.get_running_loop().call_later(0.005, self._reap, handle, tries + 1)
            return
        self._exited(handle, proc.exitcode)

    def _exited(self, handle: WorkerHandle, code: int | None) -> None:
        expected = handle.stopping is not None
        handle.exit_cause = describe_exit(code, expected, handle.signals_sent)
        handle.move("exit")
        self.last_exited[handle.model_id] = handle
        self.ledger.clear_slot(handle.slot)
        self._free_slots.append(handle.slot)
        self.by_identity.pop(handle.identity, None)
        level = logging.INFO if expected and code == 0 else logging.ERROR
        log.log(level, "Worker %s (pid %d, model %s) %s%s", handle.worker_id, handle.pid, handle.model_id,
                handle.exit_cause, f" [{handle.stop_reason}]" if handle.stop_reason else "")
        self.streams.fail_all(handle, "worker_exited", f"the worker serving {handle.model_id!r} {handle.exit_cause}")
        self._fail_calls(handle)
        if not handle.loaded.done():  # a death, as after loading: 503, retry (issue 16; was a 500)
            handle.loaded.set_exception(
                LoadError(f"worker for {handle.model_id!r} {handle.exit_cause} before the model was loaded",
                          code="worker_exited", http_status=503))
        if not handle.exited.done():
            handle.exited.set_result(code)
        self.handles.pop(handle.worker_id, None)
        self.counters["exits"] += 1
        self.on_event(Exited(handle, handle.exit_cause, expected, code))
        self.on_change()

    # -- restart intensity -----------------------------------------------------

    def may_respawn(self, model_id: str, now: float) -> tuple[bool, float]:
        """OTP-style intensity: at most restart_max restarts in restart_period
        seconds; returns (allowed, backoff delay before the next one)."""
        scfg = self.config.supervisor
        history = self.restarts[model_id]
        while history and now - history[0] > scfg.restart_period:
            history.popleft()
        if len(history) >= scfg.restart_max:
            return False, 0.0
        return True, min(10.0, 0.5 * (2 ** len(history)))

    def record_restart(self, model_id: str, now: float) -> None:
        self.restarts[model_id].append(now)
        self.counters["respawns"] += 1

    # -- shutdown ----------------------------------------------------------------

    async def shutdown(self, reason: str) -> None:
        tasks = [self.stop(h, reason, cause="shutdown") for h in list(self.handles.values()) if h.proc is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


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
