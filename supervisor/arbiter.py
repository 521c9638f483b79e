"""The arbiter: the supervisor's one loop, its signals and its shutdown.

In the manner of gunicorn's arbiter, everything that happens to the
supervisor is handled in one readable loop:

    while running:
        sleep until the next tick or until something wakes us
        (a sample over a watermark, a worker exit, a load, a signal)
        heartbeats (wedged workers are killed); respawns and retries that are due
        run the guard (probes -> policy -> actions)

Signals only set a flag and wake the loop; worker exits arrive through
process sentinels; ZeroMQ frames through socket readers. All of them run on
the same asyncio loop, so no state is shared across threads.

The arbiter builds the parts and hands each what it needs:

    pool.py      worker processes (liveness.py: is each alive?)
    enforcer.py  the guard: probes -> policy -> actions
    catalog.py   the configured models and what their files say
    models.py    each model's life: load, unload, respawn, retry, failed
    service.py   what the doors call (supervisor.doors.api.Supervisor)
    reload.py    SIGHUP and `reload`
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import msgspec
import zmq
from typing_extensions import assert_never

from shared import protocol as p
from shared.ledger import Ledger
from shared.sizes import format_size
from shared.vocab import GuardEventKind, StopCause
from supervisor.config import Config
from supervisor.doors.service import Place, Service
from supervisor.guard.admission_queue import Gate
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.enforcer import Enforcer
from supervisor.guard.eventlog import EventLog
from supervisor.models.catalog import Catalog
from supervisor.models.discovery import last_refused
from supervisor.models.life import Models
from supervisor.models.reload import Reloader
from supervisor.wiring.bus import Bus, BusError, Endpoints, claim_runtime_dir, pid_alive
from supervisor.wiring.control_answers import handle_control
from supervisor.wiring.fanout import EVENT_HISTORY, Hub
from supervisor.wiring.runtime import ensure_private_dir
from supervisor.workers import liveness
from supervisor.workers.pool import Pool
from supervisor.workers.process import (
    CacheWritten,
    Exited,
    LoadReported,
    PoolEvent,
    Reported,
    SpareNews,
    Spawned,
    Wedged,
    WorkerHandle,
    WorkerLoaded,
    WorkerLoadFailed,
    WorkerNeedsMemory,
)

if TYPE_CHECKING:
    from supervisor.http.server import EmbeddedServer

log = logging.getLogger("memvisor.arbiter")

STATUS_EVERY = 2.0  # seconds between `status` messages on PUB
ACCEPT_LOG_EVERY = 5.0  # seconds between log lines about failing accept() calls
# Stopped exits after which a pinned model comes back as after a crash: the
# guard aborted its load (P6 step 4), or it was killed for silence.
RESPAWN_CAUSES: tuple[StopCause, ...] = ("load_abort", "wedged")


class Arbiter:
    def __init__(self, config: Config, runtime_dir: Path, *, max_workers: int = 64, http: bool = True,
                 trace: Path | None = None, reload_config: Callable[[], Config] | None = None,
                 config_file: str | Path | None = None) -> None:
        self.config = config
        self.reload_config = reload_config  # re-reads the file and the models folders (SIGHUP, `reload`)
        self.config_file = Path(config_file) if config_file else None  # checked before a reload reads it
        self.trace_path = trace
        self.runtime_dir = runtime_dir
        self.max_workers = max_workers
        self.serve_http = http
        self.running = False
        self.stop_reason = ""
        self.eventlog = EventLog()
        self.events = self.eventlog.events  # SPEC S2's bounded history
        self.emit = self.eventlog.emit
        self.hub = Hub(event_history=EVENT_HISTORY)  # the PUB topics for GET /v1/events
        self.counters = SupervisorCounters()
        self.started = time.monotonic()
        self._signals = 0
        self._accept_logged = -ACCEPT_LOG_EVERY
        self._status_published = 0.0
        self.http_server: EmbeddedServer | None = None
        self.http_address = ""  # HOST:PORT the front door bound ("" while it serves none)

    # -- start and stop ------------------------------------------------------

    def setup(self) -> None:
        ensure_private_dir(self.runtime_dir)
        claim_runtime_dir(self.runtime_dir)
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(self._loop_exception)
        self.wake_event = asyncio.Event()
        self._bind()
        self._build()
        self.bus.attach(self.loop, self.pool.messages.on_reply, self.pool.messages.on_report, self.on_control)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.loop.add_signal_handler(sig, self.on_signal, sig)
        self.endpoints.save(self.runtime_dir)
        self.running = True
        log.info("memvisor supervisor pid %d; runtime dir %s; PUB %s", os.getpid(), self.runtime_dir,
                 self.endpoints.pub)

    def _bind(self) -> None:
        """The sockets and the shared-memory ledger."""
        self.ctx = zmq.Context()
        self.endpoints = Endpoints.in_dir(self.runtime_dir, pid=os.getpid(), http=self.config.supervisor.http)
        self.bus = Bus(self.ctx, self.endpoints, self.config.supervisor.max_subscribers)
        self.bus.add_listener(self.hub.publish)
        self.eventlog.bus = self.bus
        scfg = self.config.supervisor
        if scfg.pub_tcp:  # opt-in; the config refuses a non-loopback bind without CURVE keys
            try:
                endpoint, key = self.bus.bind_pub_tcp(scfg.pub_tcp, scfg.curve_key_file)
            except BusError:
                self.bus.close()
                self.ctx.term()
                raise
            self.endpoints = msgspec.structs.replace(self.endpoints, pub_tcp=endpoint, pub_tcp_key=key)
            log.info("PUB also on %s%s", endpoint, " (CURVE)" if key else "")
        self.ledger = Ledger.create(self.runtime_dir / "ledger", self.max_workers)

    def _build(self) -> None:
        """The parts, each handed what it needs (see the module's list)."""
        config, emit, wake, counters = self.config, self.emit, self.wake, self.counters
        self.pool = Pool(bus=self.bus, ledger=self.ledger, config=config, on_event=self.pool_event, on_change=wake,
                         counters=counters)
        self.enforcer = Enforcer(config=config, pool=self.pool, bus=self.bus, ledger=self.ledger, emit=emit,
                                 restarts=lambda model_id: self.models.restarts(model_id))
        if self.trace_path is not None:  # every policy snapshot, one JSON line each, for `replay`
            self.enforcer.trace = open(self.trace_path, "ab")
        self.gate = Gate(config.supervisor.queue_size, config.supervisor.queue_deadline)
        self.catalog = Catalog(config, emit=emit, counters=counters,
                               discovered_refused=last_refused() if self.reload_config is not None else {})
        self.models = Models(config, catalog=self.catalog, pool=self.pool, enforcer=self.enforcer, emit=emit,
                             wake=wake, counters=counters, running=lambda: self.running)
        self.reloader = Reloader(config, build=self.reload_config, config_file=self.config_file,
                                 catalog=self.catalog, models=self.models, pool=self.pool, enforcer=self.enforcer,
                                 emit=emit, counters=counters, configure=self.configure, wake=wake)
        self.place = Place(runtime_dir=self.runtime_dir, started=self.started, pub=self.endpoints.pub)
        self.service = Service(config, place=self.place, catalog=self.catalog, models=self.models, pool=self.pool,
                               enforcer=self.enforcer, gate=self.gate, bus=self.bus, hub=self.hub,
                               eventlog=self.eventlog, counters=counters, wake=wake,
                               reload=self.reloader.reload)

    def configure(self, config: Config) -> None:
        """A reload's new config, handed to every part that reads it."""
        self.config = config
        self.pool.config = config
        self.enforcer.config = config
        self.models.renew(config)
        self.service.config = config
        self.reloader.config = config

    async def run(self) -> int:
        """The loop. Returns the process exit code."""
        self.setup()
        try:
            if self.serve_http:
                from supervisor.http.server import start_http

                self.http_server, self.http_address = await start_http(self.service)
                self._record_http_address()
            for model in self.config.models:
                if model.pinned:
                    self.models.load_soon(model.id, "pinned model")
            self.catalog.say_refused()
            self.catalog.read_all()
            await self.serve_forever()
        finally:
            await self.shutdown()
        return 0

    async def serve_forever(self) -> None:
        """Heartbeats and housekeeping on their own clock; the policy at P9's.

        The enforcer ticks when its interval is up or when an event that can
        change its answer woke the loop (a sample over a watermark, a load, an
        exit, a request); a heartbeat alone does not run the policy (P9).
        """
        now = time.monotonic()
        next_beat = now
        interval = self.enforcer.tick(now)
        next_tick = now + interval
        while self.running:
            now = time.monotonic()
            timeout = max(0.0, min(next_tick, next_beat, self.models.next_due(now)) - now)
            woken = await self.sleep(timeout)
            if not self.running:
                break
            now = time.monotonic()
            if now >= next_beat:
                late = now - next_beat
                next_beat = now + self.config.supervisor.heartbeat_interval
                if late > liveness.stall_threshold(self.config.supervisor):
                    self.on_stall(late, now)
                self.pool.watchdog.heartbeat(now)
            self.models.tick(now)
            self.gate.expire(now)
            if woken or now >= next_tick:
                interval = self.enforcer.tick(now)
                next_tick = now + interval
            self.gate.release(self.enforcer.admission_paused, self.pool.running)
            if now - self._status_published >= STATUS_EVERY:
                self._status_published = now
                status = self.service.server_status()
                self.bus.publish(p.StatusMsg(t=time.time(), status=msgspec.json.encode(status)))

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """asyncio's own errors, with the one that floods rate-limited: out of
        descriptors, its accept loop logs a traceback per refused connection (thousands a
        second, 50-90 MB of log a minute) and the loop spends its time writing them."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
            self.counters.accept_errors += 1
            now = time.monotonic()
            if now - self._accept_logged >= ACCEPT_LOG_EVERY:
                self._accept_logged = now
                log.error("the front door cannot accept connections: %s (%d times so far; said at most "
                          "once every %.0f s)", exc.strerror or exc, self.counters.accept_errors,
                          ACCEPT_LOG_EVERY)
            return
        loop.default_exception_handler(context)

    def on_stall(self, late: float, now: float) -> None:
        """The loop itself did not run for `late` seconds (a callback that blocked,
        a machine that froze): judge every worker afresh instead of killing them all."""
        self.counters.loop_stalls += 1
        what = (f"the supervisor's loop was stalled for {late:.1f} s; every worker gets a fresh "
                f"heartbeat window (no silence during a stall counts)")
        log.warning("%s", what)
        self.pool.watchdog.forgive(now, late)
        self.emit("stall", what)

    async def sleep(self, timeout: float) -> bool:
        """Wait for a wake-up or the timeout; True when something woke the loop."""
        try:
            await asyncio.wait_for(self.wake_event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        woken = self.wake_event.is_set()
        self.wake_event.clear()
        return woken

    def wake(self) -> None:
        """Something that can change the guard's answer happened (SPEC P9)."""
        self.wake_event.set()

    def on_signal(self, sig: int) -> None:
        if sig == signal.SIGHUP:
            self.loop.create_task(self.reloader.quietly("SIGHUP"))
            return
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals > 1:
            log.warning("%s again: stopping workers without waiting for them to drain", name)
            for handle in list(self.pool.handles.values()):
                self.pool.kill(handle, f"second {name}", cause="shutdown")
            return
        log.info("%s: shutting down (press ^C again to stop without draining)", name)
        self.stop(name)

    def stop(self, reason: str = "done") -> None:
        """Leave the loop at its next turn and drain every worker (a signal, a test, a benchmark)."""
        self.stop_reason = reason
        self.running = False  # nothing respawns while the workers drain
        self.wake()

    async def shutdown(self) -> None:
        log.info("stopping %d worker(s)", len(self.pool.handles))
        if self.http_server is not None:
            self.http_server.should_exit = True
        self.hub.close("the supervisor is shutting down")  # event streams end, uvicorn can stop
        await self.pool.shutdown(f"supervisor shutting down ({self.stop_reason or 'done'})")
        if self.http_server is not None and self.http_server.task is not None:
            await asyncio.wait([self.http_server.task], timeout=5)  # let uvicorn close its connections
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.loop.remove_signal_handler(sig)
        self.bus.close()
        self.ledger.close()
        self.enforcer.close_trace()
        self.ctx.term()
        for name in ("endpoints.json", "ledger"):
            try:
                (self.runtime_dir / name).unlink()
            except FileNotFoundError:
                pass
        log.info("supervisor stopped")

    def _record_http_address(self) -> None:
        """Clients find the front door in endpoints.json (port 0 picks a free one)."""
        self.place.http = self.http_address
        if self.endpoints.http != self.http_address:
            self.endpoints = msgspec.structs.replace(self.endpoints, http=self.http_address)
            self.endpoints.save(self.runtime_dir)

    # -- what happens to workers and on the control socket ---------------------

    def pool_event(self, ev: PoolEvent) -> None:
        """What happened to a worker: published as an S2 event; crashes may respawn."""
        kind: GuardEventKind
        match ev:
            case WorkerNeedsMemory():
                self.enforcer.on_need_memory(ev.handle, ev.request_id, ev.need_bytes, ev.pool)
                return
            case Spawned():
                kind, reason = "spawn", ev.reason
            case WorkerLoaded():
                kind, reason = "loaded", ev.reason
            case WorkerLoadFailed():
                kind, reason = "load_failed", ev.reason
            case Wedged():
                kind, reason = "wedged", ev.reason
            case Reported():
                kind, reason = ev.kind, ev.reason
            case CacheWritten():
                kind, reason = "disk_cache", ev.reason
            case SpareNews():
                kind, reason = "spare", ev.reason
            case LoadReported():  # W6 while it loads, W3 once it is over
                kind, reason = ("load_phases" if ev.done else "load_progress"), ev.reason
            case Exited():
                kind, reason = ("exit" if ev.expected else "crash"), f"{ev.reason}; {returned(ev.handle)}"
            case _:
                assert_never(ev)
        handle = ev.handle
        self.emit(kind, reason, worker_id=handle.worker_id, model_id=handle.model_id,
                  usage=handle.sample.memory.usage if handle.sample else 0,
                  load=ev.report if isinstance(ev, LoadReported) else None)
        if isinstance(ev, Exited) and (not ev.expected or handle.left_because(*RESPAWN_CAUSES)):
            self.models.on_exit(handle)

    def on_control(self, identity: bytes, msg: p.ControlRequest) -> None:
        self.loop.create_task(self._control(identity, msg))

    async def _control(self, identity: bytes, msg: p.ControlRequest) -> None:
        self.bus.send_control_reply(identity, await handle_control(self.service, msg))


def returned(handle: WorkerHandle) -> str:
    """What a worker's exit gave back: its last measured usage, once its pid is gone.

    The ledger slot is cleared at exit, so the group's usage no longer counts
    it; a pid that is still there (a zombie not reaped, or a process that
    ignored its kill) is said, because the OS has not taken its memory back."""
    usage = handle.sample.memory.usage if handle.sample is not None else 0
    if pid_alive(handle.pid):
        return f"pid {handle.pid} is STILL PRESENT: its {format_size(usage)} may not have come back"
    return f"returned {format_size(usage)} (pid {handle.pid} gone)"
