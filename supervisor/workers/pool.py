"""Worker processes: spawn, command, stop with escalation, kill, reap, shut down.

One worker process per loaded model, as circus's watcher keeps its processes,
and the spare workers that wait for a model (SPEC W1: their part is
supervisor.workers.spares). The pool knows processes; it decides nothing about memory
or about a model's life. The enforcer and the models ask it to spawn and stop;
it tells them, through `on_event`, everything that happened, as typed
`PoolEvent`s, each with a cause people can read. Its neighbours each hold one
job it used to do itself, so this file reads as a process's life:
supervisor.workers.worker_messages reads what workers send, supervisor.workers.watchdog pings
them and kills the wedged (by supervisor.workers.liveness's judgement), and a handle
changes only through its own methods (supervisor.workers.process). When a model comes
back is supervisor.models.life's call (with supervisor.workers.intensity's arithmetic).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Callable

import msgspec
import multiprocess

from shared import protocol as p
from shared.ledger import Ledger
from shared.limits import Limits
from shared.vocab import StopCause
from supervisor.config import Config, ModelConfig
from supervisor.doors.refusals import LoadError
from supervisor.doors.views import WorkerView
from supervisor.guard.cache_book import CacheBook, save_grace
from supervisor.guard.counters import SupervisorCounters
from supervisor.policy.wired import sigkill_after
from supervisor.wiring.bus import Bus
from supervisor.workers import load_clock, reaping
from supervisor.workers.load_timer import LoadTimer
from supervisor.workers.process import EventSink, Exited, Spawned, WorkerHandle, worker_spec
from supervisor.workers.spares import Spares
from supervisor.workers.streams import RequestStream, Streams
from supervisor.workers.watchdog import Watchdog
from supervisor.workers.worker_messages import WorkerMessages
from worker.main import run as worker_main  # the spawn target; imports no MLX at module level

log = logging.getLogger("memvisor.pool")


class Pool:
    """The worker processes, by id and by bus identity, with their request streams."""

    def __init__(self, *, bus: Bus, ledger: Ledger, config: Config, on_event: EventSink, on_change: Callable[[], None],
                 counters: SupervisorCounters | None = None) -> None:
        self.bus = bus
        self.ledger = ledger
        self.config = config
        self.on_event = on_event
        self.on_change = on_change  # wake the enforcer
        self.handles: dict[str, WorkerHandle] = {}
        self.by_identity: dict[bytes, WorkerHandle] = {}
        self.streams = Streams()
        self._generation = 0
        self._cmd = 0
        self._free_slots = list(range(ledger.n_slots))
        self._mp = multiprocess.get_context("spawn")
        self.counters = counters if counters is not None else SupervisorCounters()
        # Off only in the reaction benchmark's baseline (the seed's fixed 1 s poll).
        self.wake_on_watermark = True
        self.caches = CacheBook()  # each model's prompt-cache disk tier, as its workers report it (H5)
        self.spares = Spares(self)  # W1, W2: the spare workers, carried out
        self.messages = WorkerMessages(self)  # what the workers say, routed (the bus's handlers)
        self.watchdog = Watchdog(self)  # the heartbeat: pings, silence judged, the wedged killed
        self.timer = LoadTimer(on_event)  # W3, W6: each load's phases and progress, said
        # model id -> its last worker reaped: its final cache report may come after its exit
        self.reaped: dict[str, WorkerHandle] = {}
        self.macos_stop_rule = sys.platform == "darwin"  # M3: SIGKILL only after the whole stop_grace

    # -- lookups ------------------------------------------------------------

    def worker_for(self, model_id: str) -> WorkerHandle | None:
        """The live worker serving `model_id` (at most one)."""
        for h in self.handles.values():
            if h.model_id == model_id and h.live:
                return h
        return None

    # -- spawning -------------------------------------------------------------

    def spawn(self, model: ModelConfig | None, *, began: float = 0.0, estimate: int = 0) -> WorkerHandle:
        """A fresh worker process for `model`, or a spare with none (None, SPEC W1). `began`:
        when the model's load began (W3's `admit` phase); `estimate`: A2's, for its progress."""
        what = repr(model.id) if model is not None else "a spare"
        if not self._free_slots:
            raise LoadError(f"no free ledger slot for {what} (all {self.ledger.n_slots} in use)",
                            code="too_many_workers", http_status=503)
        self._generation += 1
        slot = self._free_slots.pop(0)
        worker_id = f"{model.id if model is not None else 'spare'}#{self._generation}"
        handle = WorkerHandle(worker_id, model, slot, self._generation)
        spec = worker_spec(handle, self.config, self.ledger.path, self.bus.endpoints)
        proc = self._mp.Process(
            target=worker_main, args=(msgspec.msgpack.encode(spec),), name=f"memvisor-{worker_id}", daemon=False
        )
        try:
            proc.start()
        except OSError as exc:  # no descriptors or memory left for a process: the OS said no
            self._free_slots.append(slot)
            log.error("Could not start a worker for %s: %s", what, exc)
            raise LoadError(f"could not start a worker process for {what}: {exc}", code="spawn_failed",
                            http_status=503) from None
        now = time.monotonic()
        handle.started(proc, load_clock.begin(began or now, now, spare=False, estimate=estimate)
                       if model is not None else None)
        self.handles[worker_id] = handle
        self.by_identity[handle.identity] = handle
        reaping.on_exit(proc, lambda code: self._exited(handle, code), worker_id)
        self.counters.spawned += 1
        words = f"to load {model.path}" if model is not None else "as a spare: MLX and the engine, no model (W1)"
        log.info("Spawned worker %s (pid %d) %s", worker_id, proc.pid, words)
        self.on_event(Spawned(handle, f"started worker pid {proc.pid} {words}"))
        self.timer.began(handle)
        return handle

    # -- commands -------------------------------------------------------------

    def command(self, handle: WorkerHandle, msg: p.Command) -> bool:
        """Send `msg`, numbered; False when the worker is not connected yet (its hello resends
        the limits, the only command that must not be lost)."""
        self._cmd += 1
        msg.cmd = self._cmd
        if isinstance(msg, p.SetLimits):
            handle.limits_sent(msg.limits)
        ok = self.bus.send_command(handle.identity, msg)
        if not ok:
            log.debug("command %s to %s not delivered (not connected yet)", type(msg).__name__, handle.worker_id)
        return ok

    # -- a worker's limits and requests ---------------------------------------------

    def set_concurrency(self, handle: WorkerHandle, limits: Limits) -> None:
        """P8: the worker's request slots (`limits.max_concurrency`), sent with the rest of its limits."""
        handle.set_concurrency(limits.max_concurrency)
        self.set_limits(handle, limits)

    def set_limits(self, handle: WorkerHandle, limits: Limits) -> None:
        """Limits go to the ledger (read before every prefill chunk) and as a command."""
        self.ledger.write_limits(handle.slot, limits)
        if limits != handle.last_limits:
            self.command(handle, p.SetLimits(limits=limits))

    def open_request(self, handle: WorkerHandle, request_id: str) -> RequestStream:
        now = time.monotonic()
        handle.used(now)
        if handle.load is not None and not handle.load.closed:
            load_clock.request_opened(handle.load, request_id, now)
        return self.streams.open(handle.worker_id, handle.model_id, request_id)

    def cancel_request(self, stream: RequestStream, reason: str) -> None:
        """The client went away: abort in the worker, forget the stream."""
        handle = self.handles.get(stream.worker_id)
        if not stream.done and handle is not None:
            self.command(handle, p.AbortRequests(request_ids=[stream.request_id], reason=reason,
                                                 code="client_disconnected"))
        stream.done = True
        self.streams.close(stream)
        if handle is not None:
            handle.used(time.monotonic())

    def view(self, handle: WorkerHandle) -> WorkerView:
        """A frozen copy of the worker as it stands, for the doors."""
        return handle.view(self.running(handle))

    def running(self, handle: WorkerHandle) -> int:
        """Requests the worker serves now (the streams keep the map)."""
        return self.streams.running(handle.worker_id)

    async def call(self, handle: WorkerHandle, cmd: p.Tokenize | p.Detokenize, timeout: float) -> p.TokensReply:
        """A command the worker answers with one reply of the same request id (or a
        `Failed`); LoadError 503 when the worker cannot be reached or exits first,
        TimeoutError when it does not answer in `timeout` seconds."""
        waiter = self.streams.expect(handle.worker_id, cmd.request_id)
        try:
            if not self.command(handle, cmd):
                raise LoadError(f"the worker for {handle.model_id!r} is not reachable", code="worker_exited",
                                http_status=503)
            handle.used(time.monotonic())  # a use of the model: its idle timer starts again
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self.streams.forget_call(cmd.request_id)

    def read_samples(self) -> None:
        """Each live worker's ledger slot, read at the tick: its memory, and busy or idle by it."""
        for h in self.handles.values():
            if h.live:
                sample = self.ledger.read_sample(h.slot)
                if sample is not None and sample.pid == h.pid:
                    h.sampled(sample, busy=h.serving and bool(sample.running or self.running(h)))
                    if h.state == "spare":
                        self.spares.measured(sample.memory.usage)

    # -- stopping -------------------------------------------------------------

    def stop(self, handle: WorkerHandle, reason: str, *, kill_now: bool = False,
             cause: StopCause = "request") -> asyncio.Task:
        """Drain -> SIGTERM -> SIGKILL, each after a grace period. Idempotent."""
        return handle.stop(cause, reason, lambda: self._stop(handle, reason, kill_now))

    async def _stop(self, handle: WorkerHandle, reason: str, kill_now: bool) -> None:
        grace = self.config.supervisor.stop_grace
        # H5: drained, the worker may write its prompt cache to disk for `save` seconds (its own
        # deadline); the escalation waits that much longer and no more before SIGTERM.
        save = save_grace(self.config.guard)
        if not kill_now and self.command(handle, p.Drain(reason=reason, save_seconds=save)):
            if await self._wait_exit(handle, grace + save):
                return
            log.warning("Worker %s did not exit %.1f s after drain (%.1f s of it to write its prompt cache); "
                        "sending SIGTERM", handle.worker_id, grace + save, save)
        self._signal(handle, signal.SIGTERM)
        if await self._wait_exit(handle, sigkill_after(grace, self.macos_stop_rule)):
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
        handle.signalled(sig)
        try:
            os.kill(handle.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self, handle: WorkerHandle, reason: str, cause: StopCause = "request") -> asyncio.Task:
        """For a wedged worker (it will not obey a drain) or a second ^C (no time
        to wait for one): skip straight to signals. A stop already waiting for
        the worker to drain is hurried with SIGTERM; its escalation goes on."""
        if handle.stopping is not None and signal.SIGTERM not in handle.signals_sent:
            self._signal(handle, signal.SIGTERM)
        return self.stop(handle, reason, kill_now=True, cause=cause)

    # -- exits ----------------------------------------------------------------

    def _exited(self, handle: WorkerHandle, code: int | None) -> None:
        expected = handle.stopping is not None
        handle.ended(code)  # its exit_cause, its state, and whoever awaits it answered
        if not handle.spare:
            self.reaped[handle.model_id] = handle
        self.ledger.clear_slot(handle.slot)
        self._free_slots.append(handle.slot)
        self.by_identity.pop(handle.identity, None)
        # A spare stopped on purpose may still be importing (it cannot drain): its SIGTERM is no fault.
        level = logging.INFO if expected and (code == 0 or handle.spare) else logging.ERROR
        whose = f"model {handle.model_id}" if handle.model_id else "a spare"
        log.log(level, "Worker %s (pid %d, %s) %s%s", handle.worker_id, handle.pid, whose, handle.exit_cause,
                f" [{handle.leaving.reason}]" if handle.leaving and handle.leaving.reason else "")
        gone = f"the worker serving {handle.model_id!r} {handle.exit_cause}"
        self.streams.fail_all(handle.worker_id, "worker_exited", gone)
        self.streams.fail_calls(handle.worker_id, LoadError(gone, code="worker_exited", http_status=503))
        if handle.spare:
            self.spares.exited(expected, time.monotonic())
        self.handles.pop(handle.worker_id, None)
        self.counters.exits += 1
        self.on_event(Exited(handle, handle.exit_cause, expected, code))
        self.on_change()

    # -- shutdown ----------------------------------------------------------------

    async def shutdown(self, reason: str) -> None:
        tasks = [self.stop(h, reason, cause="shutdown") for h in list(self.handles.values()) if h.proc is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
