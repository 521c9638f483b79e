"""What the workers say, routed: replies on the command socket, reports on the reports socket.

The pool starts, commands, stops and reaps worker processes; what comes back
from them is read here and turned into what it means: a token for a request's
stream, a tokenizer call answered, a hello or a load that moves a worker's
state, a memory sample published for the enforcer, a pong for liveness, a
worker's own event or cache report passed on as `PoolEvent`s. One `match`
per socket, over the wire's tagged unions with `assert_never`, so a new
message nobody handles is a type error. The token frames come first: they
are nearly every message a busy worker sends.

A message from a worker we do not know (or one already gone) is counted as a
bad frame and changes nothing (SPEC: bad input never crashes the supervisor).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Protocol

from typing_extensions import assert_never

from shared import protocol as p
from supervisor.guard.cache_book import saved_words
from supervisor.workers.process import (
    CacheWritten,
    EventSink,
    Reported,
    WorkerHandle,
    WorkerLoaded,
    WorkerLoadFailed,
    WorkerNeedsMemory,
)

if TYPE_CHECKING:
    from supervisor.guard.cache_book import CacheBook
    from supervisor.guard.counters import SupervisorCounters
    from supervisor.wiring.bus import Bus
    from supervisor.workers.load_timer import LoadTimer
    from supervisor.workers.spares import Spares
    from supervisor.workers.streams import Streams
    from supervisor.workers.watchdog import Watchdog

log = logging.getLogger("memvisor.pool")


class Pool(Protocol):
    """What reading the workers' messages needs of the pool (supervisor.workers.pool.Pool)."""

    bus: Bus
    handles: dict[str, WorkerHandle]
    by_identity: dict[bytes, WorkerHandle]
    reaped: dict[str, WorkerHandle]
    streams: Streams
    caches: CacheBook
    spares: Spares
    timer: LoadTimer
    counters: SupervisorCounters
    on_event: EventSink
    on_change: Callable[[], None]
    wake_on_watermark: bool
    watchdog: Watchdog

    def command(self, handle: WorkerHandle, msg: p.Command) -> bool: ...


class WorkerMessages:
    """The bus's two handlers for what workers send (`on_reply`, `on_report`)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    # -- the command socket: replies to commands, and a worker's own news -----------

    def on_reply(self, identity: bytes, msg: p.WorkerReply) -> None:
        pool = self.pool
        handle = pool.by_identity.get(identity)
        if handle is None or not handle.live:
            pool.bus.bad("commands", "unknown_peer", "message from an unknown or stopped worker")
            return
        match msg:
            case p.TokenBatch():  # one decode step's tokens for several requests, in one frame
                self._token_batch(handle, msg)
            case p.Failed() if pool.streams.awaits(msg.request_id):  # a tokenizer call's refusal
                pool.streams.answer(msg)
            case p.TokenOut() | p.Finished() | p.Failed() | p.Prompted() | p.PrefillProgress() | p.Echoed() | p.Embedded():
                if pool.streams.deliver(msg) is not None:  # its last reply: the worker is idle since now
                    handle.used(time.monotonic())
                if handle.load is not None and handle.load.first_request:  # W3: the load's last phase
                    pool.timer.reply(handle, msg)
            case p.Tokenized() | p.Detokenized():  # a tokenizer call's answer
                pool.streams.answer(msg)
            case p.Pong():
                pool.watchdog.ponged(handle, msg.seq, time.monotonic())
            case p.Hello():
                self._hello(handle, msg)
            case p.Loaded():
                self._loaded(handle, msg)
            case p.LoadFailed():
                self._load_failed(handle, msg)
            case p.NeedMemory():
                pool.on_event(WorkerNeedsMemory(handle, msg.request_id, msg.need_bytes, msg.pool))
            case p.Ack() | p.Reclaimed():
                pass  # informational; the sample that follows carries the effect
            case _:
                assert_never(msg)

    def _token_batch(self, handle: WorkerHandle, msg: p.TokenBatch) -> None:
        pool = self.pool
        if not msg.well_formed():
            pool.bus.bad("commands", "invalid_message", "token batch with columns of unequal length")
            return
        pool.streams.deliver_batch(msg)
        if handle.load is not None and handle.load.first_request:
            pool.timer.reply(handle, msg)

    def _hello(self, handle: WorkerHandle, msg: p.Hello) -> None:
        """The process runs our code: it is loading (or, a spare, waiting for a model);
        the limits sent before it could listen are sent again."""
        pool = self.pool
        if msg.pid != handle.pid or msg.worker_id != handle.worker_id or msg.spare != handle.spare:
            pool.bus.bad("commands", "hello_mismatch", "hello that does not match the spawned process")
            return
        now = time.monotonic()
        handle.said_hello(msg, now)  # D1: its device; its state; its load's hello phase
        log.info("Worker %s (%s) runs on %s %s", handle.worker_id, handle.model_id, msg.device or "an unnamed device",
                 msg.device_info.get("device_name", ""))
        if msg.spare:
            pool.spares.greeted(handle, now)
        if handle.last_limits is not None:
            pool.command(handle, p.SetLimits(limits=handle.last_limits))
        pool.on_change()

    def _loaded(self, handle: WorkerHandle, msg: p.Loaded) -> None:
        pool = self.pool
        now = time.monotonic()
        handle.has_loaded(msg.weight_bytes, now)
        pool.timer.loaded(handle, msg, now)  # W3: the first token closes the load's phases
        log.info("Worker %s loaded %s (%.1f MB weights) in %.2f s",
                 handle.worker_id, handle.model_id, msg.weight_bytes / 1e6, msg.seconds)
        pool.on_event(WorkerLoaded(handle, f"model loaded in {msg.seconds:.2f} s"))
        pool.on_change()

    def _load_failed(self, handle: WorkerHandle, msg: p.LoadFailed) -> None:
        handle.load_failed(msg.error)  # marked: it exits next, and its load's waiters hear why
        self.pool.on_event(WorkerLoadFailed(handle, msg.error))

    # -- the reports socket: samples, events, heartbeats, cache figures ---------------

    def on_report(self, msg: p.WorkerReport) -> None:
        match msg:
            case p.Sample():
                self._sample(msg)
            case p.WorkerEvent():
                handle = self.pool.handles.get(msg.worker_id)
                if handle is not None:
                    self.pool.on_event(Reported(handle, msg.kind, msg.message))
            case p.Alive():
                self._alive(msg)
            case p.CacheReport():
                self._cache_report(msg)
            case _:
                assert_never(msg)

    def _sample(self, msg: p.Sample) -> None:
        pool = self.pool
        handle = pool.handles.get(msg.worker_id)
        if handle is None or msg.pid != handle.pid:
            pool.bus.bad("reports", "unknown_peer", "sample from an unknown worker")
            return
        pool.counters.samples += 1
        pool.bus.publish(msg)
        if msg.why in ("watermark", "shrink") and pool.wake_on_watermark:
            # P9: a watermark crossing is answered now, not at the next tick; H3: so is a shrink
            pool.on_change()

    def _alive(self, msg: p.Alive) -> None:
        handle = self.pool.handles.get(msg.worker_id)
        if handle is None or msg.pid != handle.pid:
            return  # the last word of a worker that has just exited: it changes nothing
        handle.heard(msg, time.monotonic())
        if msg.load_phase:
            self.pool.timer.alive(handle, msg)

    def _cache_report(self, msg: p.CacheReport) -> None:
        """H5: a worker's disk-tier figures; the last one comes as it exits, maybe after its reaping."""
        pool = self.pool
        handle = pool.handles.get(msg.worker_id)
        if handle is None:
            last = pool.reaped.get(msg.model_id)
            handle = last if last is not None and last.worker_id == msg.worker_id else None
        if handle is None or handle.pid != msg.pid or handle.model_id != msg.model_id:
            pool.bus.bad("reports", "unknown_peer", "cache report from an unknown worker")
            return
        pool.caches.take(msg)
        s = msg.stats
        if msg.final and (s.written_entries or s.dropped_entries):
            pool.counters.disk_cache_saves += 1
            pool.on_event(CacheWritten(handle, saved_words(s)))
