"""The arbiter: the supervisor's one loop.

In the manner of gunicorn's arbiter, everything that happens to the
supervisor is handled in one readable loop:

    while running:
        sleep until the next tick or until something wakes us
        (a sample over a watermark, a worker exit, a load, a signal)
        reap what exited; detect wedged workers; respawn what is due
        run the guard (probes -> policy -> actions)

Signals only set a flag and wake the loop; worker exits arrive through
process sentinels; ZeroMQ frames through socket readers. All of them run on
the same asyncio loop, so no state is shared across threads.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import math
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import msgspec
import zmq
from typing_extensions import assert_never

from shared import probe
from shared import protocol as p
from shared.embedding import WRONG_MODEL_KIND, EmbeddingSpec, read_embedding_spec
from shared.ledger import Ledger
from shared.memory import NO_READING
from shared.modelinfo import FileRefused, context_length, open_regular
from shared.sizes import format_size
from shared.states import LOADING_STATES
from shared.vocab import ErrorCode, GuardEventKind
from shared.weights import WeightsError, estimate_weight_bytes, kv_bytes_per_token
from supervisor.bus import Bus, BusError, Endpoints, FrameTooLarge, claim_runtime_dir, pid_alive
from supervisor.config import Config, ConfigError, ModelConfig, guard_settings, host_name
from supervisor.discovery import last_refused, refusal
from supervisor.enforcer import Enforcer
from supervisor.errors import AtCapacity, LoadError, ModelUnreadable, NotReady, ServeError
from supervisor.fanout import EVENT_HISTORY, Hub, Subscription
from supervisor.gate import Gate
from supervisor.offloop import MODEL_FILES_TIMEOUT, OffLoopTimeout, off_loop
from supervisor.policy.admission import FitReport, fit_report
from supervisor.policy.status import DiskCacheStatus, ModelInfo, ServerStatus
from supervisor.pool import (
    CacheWritten,
    Exited,
    ModelView,
    Pool,
    PoolEvent,
    Reported,
    Spawned,
    WorkerHandle,
    WorkerLoaded,
    WorkerLoadFailed,
    WorkerNeedsMemory,
)
from supervisor.readiness import LoadProgress, Readiness, assess, load_progress, loading_retry, saturated
from supervisor.runtime import ensure_private_dir
from supervisor.streams import RequestStream

if TYPE_CHECKING:
    from supervisor.http.app import EmbeddedServer

log = logging.getLogger("memvisor.arbiter")

STATUS_EVERY = 2.0  # seconds between `status` messages on PUB
# Issue 21: what the loop hands to a thread, and how long it waits for it.
RELOAD_TIMEOUT = 60.0  # the config file and every models folder
CONFIG_FILE_MAX = 16 * 1024 * 1024  # a config file larger than this is refused, not read
ACCEPT_LOG_EVERY = 5.0  # seconds between log lines about failing accept() calls
# Issue 24: a request that will not wait for a load still waits this long for
# one, so a refusal it can act on (failed, does not fit) reaches it first.
LOAD_GRACE = 0.25
# An OSError that says nothing about the file (out of descriptors or memory): 503, retry.
_PASSING_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM, errno.EINTR})


class Arbiter:
    def __init__(self, config: Config, runtime_dir: Path, *, max_workers: int = 64, http: bool = True,
                 trace: Path | None = None, reload_config: Callable[[], Config] | None = None,
                 config_file: str | Path | None = None) -> None:
        self.config = config
        self.reload_config = reload_config  # re-reads the file and the models folders (SIGHUP, `reload`)
        self.config_file = Path(config_file) if config_file else None  # checked before a reload reads it
        self._reload_since: float | None = None  # a reload's thread is reading (issue 21)
        self._reads: dict[str, asyncio.Task] = {}  # model path -> its files being read off the loop
        self._refused: set[tuple[str, str]] = set()  # (path, why) already said as an event
        self._estimates: dict[str, int] = {}  # model path -> A2 weight estimate
        self._kv: dict[str, int] = {}  # model path -> KV bytes per token of context (fit)
        # id -> (path, why): models in a models folder whose files discovery refused (issue 21)
        self._discovered_refused = last_refused() if reload_config is not None else {}
        self.trace_path = trace
        self.runtime_dir = runtime_dir
        self.max_workers = max_workers
        self.serve_http = http
        self.running = False
        self.stop_reason = ""
        self.events: collections.deque[p.GuardEvent] = collections.deque(maxlen=EVENT_HISTORY)
        self.event_hooks: list[Callable[[p.GuardEvent], None]] = []  # e.g. the metrics' counters
        self.hub = Hub(event_history=EVENT_HISTORY)  # issue 15: PUB topics for GET /v1/events
        self.started = time.monotonic()
        self._load_lock = asyncio.Lock()  # A5; binds to the running loop on first use
        self._loading: dict[str, asyncio.Task] = {}
        self._load_began: dict[str, float] = {}  # model id -> when its load in flight began (issue 24)
        self._respawn_due: dict[str, float] = {}
        self._context: dict[str, int] = {}  # model id -> context tokens from config.json (-1: unknown)
        self._embedding: dict[str, EmbeddingSpec | None] = {}  # model id -> how it embeds (None: it chats)
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
        self.ctx = zmq.Context()
        self.endpoints = Endpoints.in_dir(self.runtime_dir, pid=os.getpid(), http=self.config.supervisor.http)
        self.bus = Bus(self.ctx, self.endpoints, self.config.supervisor.max_subscribers)
        self.bus.add_listener(self.hub.publish)  # issue 15
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
        self.pool = Pool(bus=self.bus, ledger=self.ledger, config=self.config,
                         on_event=self.pool_event, on_change=self.wake)
        self.enforcer = Enforcer(config=self.config, pool=self.pool, bus=self.bus, ledger=self.ledger,
                                 emit=self.emit)
        self.gate = Gate(self.config.supervisor.queue_size, self.config.supervisor.queue_deadline)
        if self.trace_path is not None:  # every policy snapshot, one JSON line each, for `replay`
            self.enforcer.trace = open(self.trace_path, "ab")
        self.bus.attach(self.loop, self.pool.on_reply, self.pool.on_report, self.on_control)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.loop.add_signal_handler(sig, self.on_signal, sig)
        self.endpoints.save(self.runtime_dir)
        self.running = True
        log.info("memvisor supervisor pid %d; runtime dir %s; PUB %s", os.getpid(), self.runtime_dir,
                 self.endpoints.pub)

    async def run(self) -> int:
        """The loop. Returns the process exit code."""
        self.setup()
        try:
            if self.serve_http:
                from supervisor.http.app import start_http

                self.http_server, self.http_address = await start_http(self)
                self._record_http_address()
            for model in self.config.models:
                if model.pinned:
                    self.loop.create_task(self._load_quietly(model.id, "pinned model"))
            self._say_refused()
            self._read_all(self.config)
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
            timeout = max(0.0, min(next_tick, next_beat, self._next_respawn(now)) - now)
            woken = await self.sleep(timeout)
            if not self.running:
                break
            now = time.monotonic()
            if now >= next_beat:
                late = now - next_beat
                next_beat = now + self.config.supervisor.heartbeat_interval
                if late > self.stall_threshold():
                    self.on_stall(late, now)
                for handle in self.pool.heartbeat(now):
                    self.on_wedged(handle)
            self.respawn_due(now)
            self.gate.expire(now)
            if woken or now >= next_tick:
                interval = self.enforcer.tick(now)
                next_tick = now + interval
            self.gate.release(self.enforcer.admission_paused)
            if now - self._status_published >= STATUS_EVERY:
                self._status_published = now
                self.bus.publish(p.StatusMsg(t=time.time(), status=msgspec.json.encode(self.server_status())))

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """asyncio's own errors, with the one that floods rate-limited (issue 21): out of
        descriptors, its accept loop logs a traceback per refused connection (thousands a
        second, 50-90 MB of log a minute) and the loop spends its time writing them."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
            self.pool.counters["accept_errors"] += 1
            now = time.monotonic()
            if now - self._accept_logged >= ACCEPT_LOG_EVERY:
                self._accept_logged = now
                log.error("the front door cannot accept connections: %s (%d times so far; said at most "
                          "once every %.0f s)", exc.strerror or exc, self.pool.counters["accept_errors"],
                          ACCEPT_LOG_EVERY)
            return
        loop.default_exception_handler(context)

    def stall_threshold(self) -> float:
        """How late a beat may be before the loop counts as stalled: a silence can
        only be judged on time the loop could observe (issue 21). Half the
        window at most, so a stall just short of it is still forgiven."""
        scfg = self.config.supervisor
        return min(scfg.heartbeat_timeout / 2, max(0.5, scfg.heartbeat_interval))

    def on_stall(self, late: float, now: float) -> None:
        """The loop itself did not run for `late` seconds (a callback that blocked,
        a machine that froze): judge every worker afresh instead of killing them all."""
        self.pool.counters["loop_stalls"] += 1
        what = (f"the supervisor's loop was stalled for {late:.1f} s; every worker gets a fresh "
                f"heartbeat window (no silence during a stall counts)")
        log.warning("%s", what)
        self.pool.forgive(now, late)
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
            self.loop.create_task(self._reload_quietly())
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
        self.running = False
        self.wake()

    async def shutdown(self) -> None:
        log.info("stopping %d worker(s)", len(self.pool.handles))
        if self.http_server is not None:
            self.http_server.should_exit = True
        self.hub.close("the supervisor is shutting down")  # issue 15: event streams end, uvicorn can stop
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

    # -- events ----------------------------------------------------------------

    def emit(self, kind: GuardEventKind, reason: str, *, worker_id: str = "", model_id: str = "", usage: int = 0,
             ceiling: int = 0) -> None:
        """SPEC S2: kept in a bounded history and published to subscribers."""
        ev = p.GuardEvent(t=time.time(), kind=kind, reason=reason, worker_id=worker_id, model_id=model_id,
                          usage=usage, ceiling=ceiling)
        self.events.append(ev)
        self.bus.publish(ev)
        for hook in self.event_hooks:
            hook(ev)

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
            case Reported():
                kind, reason = ev.kind, ev.reason
            case CacheWritten():
                kind, reason = "disk_cache", ev.reason
            case Exited():
                kind, reason = ("exit" if ev.expected else "crash"), f"{ev.reason}; {returned(ev.handle)}"
            case _:
                assert_never(ev)
        handle = ev.handle
        self.emit(kind, reason, worker_id=handle.worker_id, model_id=handle.model_id,
                  usage=handle.sample.memory.usage if handle.sample else 0)
        if isinstance(ev, Exited) and (not ev.expected or handle.stop_cause == "load_abort"):
            self.on_crash(handle)  # a pinned model whose load pressure aborted comes back too

    # -- crashes, wedges and respawns ------------------------------------------

    def on_wedged(self, handle: WorkerHandle) -> None:
        now = time.monotonic()
        loading = handle.state in LOADING_STATES
        silent = now - (handle.spawned_at if loading else handle.last_pong)
        step = self.pool.step_seconds(handle, now)
        if loading and self.pool.silent_while_loading(handle, now):
            since = handle.last_alive or handle.spawned_at
            what = f"no heartbeat for {now - since:.1f} s while starting or loading"
        elif loading:
            what = f"still loading after {silent:.0f} s"
        elif step > 0:
            what = (f"one engine step has run for {step:.0f} s (supervisor.step_timeout "
                    f"{self.config.supervisor.step_timeout:g} s)")
        else:
            what = f"no heartbeat for {silent:.1f} s"
        self.pool.counters["wedged"] += 1
        log.error("Worker %s (pid %d): %s: wedged; killing it", handle.worker_id, handle.pid, what)
        handle.move("silent")
        self.emit("wedged", what, worker_id=handle.worker_id, model_id=handle.model_id)
        self.pool.kill(handle, "wedged", cause="wedged")
        handle.exited.add_done_callback(lambda _exit: self.on_crash(handle))

    def on_crash(self, handle: WorkerHandle) -> None:
        """A pinned model comes back, within the restart intensity; others wait for demand."""
        if handle.pinned and self.config.model(handle.model_id) is not None:
            self.schedule_respawn(handle.model_id, handle.exit_cause)

    def schedule_respawn(self, model_id: str, cause: str) -> None:
        if not self.running or model_id in self._respawn_due or model_id in self.pool.failed:
            return
        now = time.monotonic()
        allowed, delay = self.pool.may_respawn(model_id, now)
        if not allowed:
            scfg = self.config.supervisor
            why = f"{scfg.restart_max} restarts within {scfg.restart_period:.0f} s (last: {cause})"
            delay = self.pool.mark_failed(model_id, why, now)
            log.error("Model %s marked failed: %s; next try in %.0f s", model_id, why, delay)
            self.emit("failed", f"{why}; next try in {delay:.0f} s", model_id=model_id)
            self.wake()
            return
        self._respawn_due[model_id] = now + delay
        log.info("Respawning pinned model %s in %.1f s", model_id, delay)
        self.wake()

    def _next_respawn(self, now: float) -> float:
        return min([*self._respawn_due.values(), *self.pool.retry_at.values()], default=now + 3600)

    def retry_failed(self, model_id: str, why: str) -> None:
        """failed -> stopped (issue 16); a pinned model is loaded again at once."""
        if not self.pool.retry(model_id):
            return
        log.info("Model %s: trying again (%s)", model_id, why)
        self.emit("retry", f"failed model tried again: {why}", model_id=model_id)
        model = self.config.model(model_id)
        if model is not None and model.pinned and why != "explicit load":
            self.pool.record_restart(model_id, time.monotonic())
            self.loop.create_task(self._load_quietly(model_id, "retry after failure"))

    def respawn_due(self, now: float) -> None:
        for model_id, due in list(self.pool.retry_at.items()):
            if due <= now:
                self.retry_failed(model_id, "its backoff has passed")
        for model_id, due in list(self._respawn_due.items()):
            if due <= now:
                del self._respawn_due[model_id]
                self.pool.record_restart(model_id, now)
                self.emit("respawn", "pinned model respawned after its worker exited", model_id=model_id)
                self.loop.create_task(self._load_quietly(model_id, "respawn"))

    async def _load_quietly(self, model_id: str, why: str) -> None:
        try:
            await self.load(model_id)
        except LoadError as exc:
            log.error("could not load %s (%s): %s", model_id, why, exc)
            # a pinned model that cannot come up is tried again, within the
            # restart intensity, and then marked failed with the reason; any
            # other waits for demand (issue 21: one reloaded with a new path
            # was respawned like a pinned one)
            model = self.config.model(model_id)
            if model is not None and model.pinned:
                self.schedule_respawn(model_id, f"load failed: {exc}")

    def give_up(self, model_id: str, why: str) -> None:
        """Issue 21: a model whose files its worker could not load is marked failed
        with the backoff of issue 16, pinned or not, so requests are refused at
        once with when the next try is, instead of each paying for a spawn."""
        delay = self.pool.mark_failed(model_id, why, time.monotonic())
        log.error("Model %s marked failed: %s; next try in %.0f s", model_id, why, delay)
        self.emit("failed", f"{why}; next try in {delay:.0f} s", model_id=model_id)
        self.wake()

    # -- loads (SPEC A) ------------------------------------------------------------

    def model_config(self, model_id: str) -> ModelConfig:
        model = self.config.model(model_id)
        if model is None:
            refused = self._discovered_refused.get(model_id)
            if refused is not None:  # issue 21: not a model, and the 404 says why
                raise LoadError(f"the model {model_id!r} is not served: its files in {refused[0]} were refused "
                                f"when the models folder was scanned: {refused[1]}", code="model_not_found",
                                http_status=404)
            raise LoadError(f"the model {model_id!r} does not exist", code="model_not_found", http_status=404)
        return model

    def _say_refused(self) -> None:
        """A `refused` event (and a count) for each model discovery refused, once per file and reason."""
        for model_id, (path, why) in self._discovered_refused.items():
            if (path, why) not in self._refused:
                self._refused.add((path, why))
                self.pool.counters["model_files_refused"] += 1
                log.warning("Models folder: %s (%s) is not served: %s", model_id, path, why)
                self.emit("refused", f"not a model, not served: {why}", model_id=model_id)

    async def load(self, name: str, *, explicit: bool = False, _moved: int = 0) -> WorkerHandle:
        """Ready worker for the model `name` (an id or alias); every concurrent caller shares one load (A5).

        A failed model refuses with when its next try is (Retry-After), except
        to an explicit load (HTTP load route, `load` command): that is the
        operator saying "try now" (issue 16)."""
        model = self.model_config(name)
        model_id = model.id
        handle = self.pool.worker_for(model_id)
        if handle is not None and handle.serving and not handle.marked_for_unload:
            return handle
        if model_id in self.pool.failed:
            if explicit:
                self.retry_failed(model_id, "explicit load")
            else:
                retry = self.pool.retry_in(model_id, time.monotonic())
                raise LoadError(f"model {model_id!r} is marked failed: {self.pool.model_view(model_id).reason}",
                                code="model_failed", http_status=503,
                                retry_after=max(1, math.ceil(retry)) if retry is not None else None,
                                permanent=retry is None)
        task = self._loading.get(model_id)
        if task is None:
            task = self.loop.create_task(self._load(model, handle))
            self._loading[model_id] = task
            self._load_began[model_id] = time.monotonic()
            task.add_done_callback(lambda _t: self._loading.pop(model_id, None))
        try:
            return await asyncio.shield(task)
        except LoadError:
            current = self.config.model(name)
            if current is None or current.path == model.path or _moved > 2:
                raise
        # issue 21: a reload changed the model's path while we waited; its old
        # worker was stopped on purpose, so the request waits for the new path's
        log.info("Model %s moved to %s while a request waited for its load; loading that", model_id, current.path)
        return await self.load(name, explicit=explicit, _moved=_moved + 1)

    async def _load(self, model: ModelConfig, handle: WorkerHandle | None) -> WorkerHandle:
        try:
            return await self._load_locked(model, handle)
        except LoadError as exc:
            if exc.permanent and not model.pinned and self.config.model(model.id) == model:
                self.give_up(model.id, str(exc))  # a pinned one goes through its restart intensity
            raise

    async def _load_locked(self, model: ModelConfig, handle: WorkerHandle | None) -> WorkerHandle:
        if self.pool.worker_for(model.id) is None:
            await self.read_model_files(model)  # off the loop, bounded, before the lock (issue 21)
        async with self._load_lock:  # A5: one model load at a time
            if handle is None or not handle.live:
                handle = self.pool.worker_for(model.id)
            if handle is not None and (handle.marked_for_unload or handle.stopping is not None):
                # on its way out (pressure or unload): let it finish, then load afresh
                await self.pool.stop(handle, handle.stop_reason or "marked for unload")
                handle = None
            if handle is None:
                await self.enforcer.admit(model)
                handle = self.pool.spawn(await self._gguf_imported(model))
                self.enforcer.note_load_started(handle)
                self.wake()
            await handle.loaded
        self.wake()
        return handle

    async def fit(self, name: str, context_tokens: int = 0) -> FitReport:
        """"Will it fit?": the files are read off the loop first (issue 21: a dry run
        read the headers and config.json on the loop when nothing was cached)."""
        model = self.model_config(name)
        await self.read_model_files(model)
        return fit_report(self.enforcer.snapshot(time.monotonic()), model.id, self._estimates.get(model.path, 0),
                          self._kv.get(model.path, 0), context_tokens)

    async def _gguf_imported(self, model: ModelConfig) -> ModelConfig:
        """A `.gguf` path loads from its imported MLX folder, imported on first load (issue 12)."""
        from shared.gguf import is_gguf_path
        from supervisor.gguf import GGUFImportError, cache_folder, ensure_imported, is_imported

        if not is_gguf_path(model.path):
            return model
        try:
            if not is_imported(cache_folder(model.path)):
                self.emit("import", f"importing {model.path} into the cache (first load)", model_id=model.id)
            folder = await ensure_imported(model.path)
        except (GGUFImportError, OSError) as exc:
            self.emit("refused", f"cannot import {model.path}: {exc}", model_id=model.id)
            words = f"model {model.id!r}: cannot import {model.path}: {exc}"
            if isinstance(exc, OSError) and exc.errno in _PASSING_ERRNOS:
                raise LoadError(words, code="model_unreadable", http_status=503, retry_after=1) from None
            raise ModelUnreadable(words) from None
        return msgspec.structs.replace(model, path=str(folder))

    async def unload(self, name: str, reason: str = "unloaded on request") -> bool:
        model_id = self.model_config(name).id
        handle = self.pool.worker_for(model_id)
        if handle is None:
            return False
        self.emit("unload", reason, worker_id=handle.worker_id, model_id=model_id)
        await self.pool.stop(handle, reason, cause="unload")
        return True

    # -- requests --------------------------------------------------------------------

    def admission_open(self, handle: WorkerHandle) -> bool:
        """SPEC P3: paused admission still lets an idle worker take one request."""
        return not self.enforcer.admission_paused or not handle.requests

    def check_request(self, model: ModelConfig, gen: p.Generate) -> None:
        """Issue 16: what can be refused before a worker exists (the prompt's
        length in tokens is checked by the worker, which tokenizes it)."""
        if self._embedding.get(model.id) is not None:  # an embedder has no chat to give
            raise ServeError(f"model {model.id!r} is an embedding model: it serves /v1/embeddings and /api/embed, "
                             "not chat, completions or generation", code=WRONG_MODEL_KIND, http_status=400)
        cap = self.config.supervisor.max_tokens
        if gen.max_tokens > cap:
            raise ServeError(f"max_tokens ({gen.max_tokens}) exceeds this server's cap of {cap} "
                             "([supervisor] max_tokens)", code="invalid_request", http_status=400)
        context = self._context.get(model.id, 0)  # read off the loop by generate (issue 21); 0: unknown
        if context > 0 and gen.max_tokens >= context:
            raise ServeError(f"max_tokens ({gen.max_tokens}) leaves no room for a prompt in the model's "
                             f"context of {context} tokens", code="context_length_exceeded", http_status=400)

    async def generate(self, model_id: str, gen: p.Generate, max_wait: float | None = None) -> RequestStream:
        """A stream of `gen` on the model's worker. `max_wait` (issue 24: a router's
        X-Memvisor-Max-Wait) bounds the seconds it may wait before its worker takes
        it; past that it is refused with a 503 the router can act on (NotReady)."""
        model = self.model_config(model_id)
        if model.id not in self._context:  # its config.json is read off the loop, never here (issue 21)
            if self.pool.worker_for(model.id) is None:
                await self.read_model_files(model)  # the load needs it anyway
            else:  # loaded: its worker checks the context itself (issue 16); read it for the next one
                self._read_soon(model)
        self.check_request(model, gen)
        return await self._submit(model, gen, max_wait)

    async def embedding_spec(self, model_id: str) -> EmbeddingSpec | None:
        """How the model embeds (its folder's sentence-transformers files, read off
        the loop once), or None for a model that generates text."""
        model = self.model_config(model_id)
        if model.id not in self._context:
            await self.read_model_files(model)
        return self._embedding.get(model.id)

    async def embed(self, model_id: str, cmd: p.Embed) -> RequestStream:
        """An embedding request, under the same load, admission and gate as a generation."""
        if await self.embedding_spec(model_id) is None:
            raise ServeError(f"model {model_id!r} generates text; it is not an embedding model (serve a "
                             "sentence-transformers folder for embeddings)", code=WRONG_MODEL_KIND, http_status=400)
        return await self._submit(self.model_config(model_id), cmd)

    async def _submit(self, model: ModelConfig, gen: p.Generate | p.Embed,
                      max_wait: float | None = None) -> RequestStream:
        model_id = model.id
        handle = await self._loaded(model, max_wait)
        self._check_room(model, handle, max_wait)
        if not self.admission_open(handle):
            if max_wait is not None and max_wait <= 0:
                raise NotReady(f"memory pressure has paused admission to {model.id!r} and this request "
                               "will not wait (X-Memvisor-Max-Wait)", code="admission_paused", retry_after=2)
            await self.gate.wait(handle, max_wait)
        if not handle.live:  # it exited while we waited (load, gate): no one would end the stream
            raise LoadError(f"the worker for {model_id!r} stopped before the request reached it",
                            code="worker_exited", http_status=503)
        gen.request_id = gen.request_id or uuid.uuid4().hex
        try:
            delivered = self.pool.command(handle, gen)
        except FrameTooLarge as exc:
            raise LoadError(f"the request is too large to hand to a worker: {exc}; shorten the prompt",
                            code="request_too_large", http_status=413) from None
        if not delivered:
            raise LoadError(f"the worker for {model_id!r} is not reachable", code="worker_exited",
                            http_status=503)
        # No reply can arrive before this: both run in this one loop callback.
        stream = self.pool.open_request(handle, gen.request_id)
        self.wake()
        return stream

    async def tokens(self, model_id: str, cmd: p.Tokenize | p.Detokenize) -> p.TokensReply:
        """Issue 23: the model's tokenizer on request, loaded on demand like a generation
        (A2-A5); the worker answers between two steps, so the wait is at most one step."""
        handle = await self.load(self.model_config(model_id).id)
        if not handle.live:
            raise LoadError(f"the worker for {model_id!r} stopped before the request reached it",
                            code="worker_exited", http_status=503)
        try:
            return await self.pool.call(handle, cmd, self.config.supervisor.step_timeout + 5.0)
        except FrameTooLarge as exc:
            raise LoadError(f"the request is too large to hand to a worker: {exc}; send less text",
                            code="request_too_large", http_status=413) from None
        except TimeoutError:
            raise LoadError(f"the worker for {model_id!r} did not answer in time", code="worker_timeout",
                            http_status=503) from None

    async def _loaded(self, model: ModelConfig, max_wait: float | None) -> WorkerHandle:
        """The model's worker once loaded; with `max_wait`, a load that takes longer goes
        on for the next request while this one is refused with its progress."""
        handle = self.pool.worker_for(model.id)
        if max_wait is None or (handle is not None and handle.serving and not handle.marked_for_unload):
            return await self.load(model.id)
        task = self.loop.create_task(self.load(model.id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is the next one's
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(max_wait, LOAD_GRACE))
        except asyncio.TimeoutError:
            progress = self.load_progress(model.id, time.monotonic())
            raise NotReady(f"model {model.id!r} is loading; this request will not wait for it "
                           "(X-Memvisor-Max-Wait)", code="model_loading", retry_after=loading_retry(progress),
                           progress=progress) from None

    def _check_room(self, model: ModelConfig, handle: WorkerHandle, max_wait: float | None) -> None:
        """Issue 24: a 429 when the model's slots and queue are full; for a request that will
        not wait, a 503 when its worker has stopped answering (a router tries another host)."""
        in_flight = len(handle.requests) + self.gate.waiting_for(handle)
        if saturated(handle.model, in_flight):
            self.pool.counters["at_capacity"] += 1
            raise AtCapacity(f"model {model.id!r} runs {handle.model.max_concurrency} requests and "
                             f"{in_flight - handle.model.max_concurrency} more wait (max_queue "
                             f"{handle.model.max_queue}); retry later or elsewhere", retry_after=1)
        silent = self._silent(handle, time.monotonic())
        if max_wait is not None and silent is not None:
            raise NotReady(f"the worker for {model.id!r} has not answered for {silent:.1f} s",
                           code="worker_unresponsive", retry_after=2)

    def cancel(self, stream: RequestStream, reason: str = "client disconnected") -> None:
        self.pool.cancel_request(stream, reason)
        self.wake()

    def keep_alive(self, model_id: str, seconds: float) -> None:
        """Issue 13 (Ollama keep_alive, LM Studio ttl): the worker's own copy of its model's
        config carries the TTL P10 reads, so it lasts until that worker stops."""
        handle = self.pool.worker_for(self.model_config(model_id).id)
        if handle is not None:
            handle.model = msgspec.structs.replace(handle.model, ttl=seconds)
            self.wake()

    # -- routing signals (issue 24) ---------------------------------------------------

    def readiness(self, name: str) -> Readiness:
        """What a request for the model would meet now (supervisor.readiness)."""
        model = self.model_config(name)
        now = time.monotonic()
        handle = self.pool.worker_for(model.id)
        fit, snapshot, size = None, self.enforcer.last_snapshot, self._estimates.get(model.path, 0)
        if handle is None and snapshot is not None and size > 0:  # the last tick's figures: no probe here
            fit = fit_report(snapshot, model.id, size, 0, 0)
        return assess(model=handle.model if handle is not None else model, host=host_name(self.config),
                      view=self.pool.model_view(model.id), handle=handle,
                      waiting=self.gate.waiting_for_model(model.id), paused=self.enforcer.admission_paused,
                      silent=self._silent(handle, now), progress=self.load_progress(model.id, now), fit=fit)

    def _silent(self, handle: WorkerHandle | None, now: float) -> float | None:
        """Seconds a serving worker has not answered a ping, once past half the heartbeat
        window (a SIGSTOPped worker, before it is killed as wedged); None otherwise."""
        if handle is None or not handle.serving:
            return None
        scfg = self.config.supervisor
        silent = now - handle.last_pong
        limit = max(2 * scfg.heartbeat_interval, scfg.heartbeat_timeout / 2)
        return silent if silent > limit and not self.pool.in_long_step(handle, now) else None

    def load_progress(self, model_id: str, now: float) -> LoadProgress | None:
        """How far the model's load in flight has come (None: no load in flight)."""
        if model_id not in self._loading:
            return None
        began = self._load_began.get(model_id, now)
        handle = self.pool.worker_for(model_id)
        model = self.config.model(model_id)
        estimate = self._estimates.get(model.path, 0) if model is not None else 0
        if handle is None or handle.state not in LOADING_STATES:
            return load_progress("queued", began, now, 0, estimate)
        grown = 0
        sample = handle.sample
        if handle.state == "loading" and sample is not None and sample.phase == "loading":
            grown = (probe.footprint(handle.pid) or 0) - sample.memory.usage  # since it reported, before its weights
        return load_progress(handle.state, began, now, grown, estimate)

    # -- status ----------------------------------------------------------------------

    def model_view(self, name: str) -> ModelView:
        model = self.config.model(name)
        return self.pool.model_view(model.id if model is not None else name)

    def model_info(self, name: str) -> ModelInfo:
        return self._model_info(self.model_config(name), time.monotonic())

    def _model_info(self, m: ModelConfig, now: float) -> ModelInfo:
        """Everything `ps` shows of one model, worked out here only."""
        view = self.pool.model_view(m.id)
        handle = self.pool.worker_for(m.id)
        sample = handle.sample if handle is not None else None
        memory = sample.memory if sample else NO_READING
        idle = now - handle.last_access if handle is not None and not handle.requests else 0.0
        own = handle.model.ttl if handle is not None else m.ttl  # issue 13: keep_alive sets the handle's
        ttl = own if own is not None else (self.config.supervisor.idle_timeout or None)
        expires = None
        if ttl and handle is not None and handle.serving and not m.pinned:
            expires = max(0.0, ttl - idle)
        disk = self.pool.caches.model(m.id)  # H5: as its last worker reported it
        return ModelInfo(
            id=m.id, path=m.path, pinned=m.pinned, state=view.state, worker=view.worker, pid=view.pid,
            failed_reason=view.reason, aliases=list(m.aliases), estimated_bytes=self._estimate(m),
            usage=memory.usage, mlx_active=memory.mlx_active, mlx_pool=memory.mlx_pool,
            cache_bytes=memory.cache_bytes, batch_bytes=memory.batch_bytes,
            batch_live_bytes=memory.batch_live_bytes, disk_cache_bytes=disk.bytes, disk_cache_entries=disk.entries,
            idle_seconds=idle, ttl=ttl, expires_in=expires,
            restarts=len(self.pool.restarts.get(m.id, ())),
        )

    def _estimate(self, m: ModelConfig) -> int:
        """A2's weight estimate as last read off the loop (0 until it has been, or when
        the files cannot be read); status never reads a model's files itself (issue 21)."""
        if m.path not in self._estimates and m.path not in self._reads:
            self._read_soon(m)
        return self._estimates.get(m.path, 0)

    # -- model files, read off the loop (issue 21) ----------------------------------------

    def _read_all(self, config: Config) -> None:
        for model in config.models:
            self._read_soon(model)

    def _read_soon(self, model: ModelConfig) -> None:
        async def quietly() -> None:
            try:
                await self.read_model_files(model)
            except LoadError:
                pass  # said as an event by the read

        self.loop.create_task(quietly())

    async def read_model_files(self, model: ModelConfig) -> None:
        """A2's estimate and the context window, read on a thread with a time bound,
        before anything on the loop needs them (shared.weights answers from what was
        read after that). Concurrent callers share one read; LoadError when refused."""
        task = self._reads.get(model.path)
        joined = task is not None
        if task is None:
            task = self.loop.create_task(self._read_files(model))
            self._reads[model.path] = task
            task.add_done_callback(lambda _t: self._reads.pop(model.path, None))
        try:
            await asyncio.shield(task)
        except _ReadFailed:
            if not joined:
                raise
            await self.read_model_files(model)  # a read begun earlier failed for a passing reason: read anew

    async def _read_files(self, model: ModelConfig) -> None:
        def read() -> tuple[int | None, int | str, int, EmbeddingSpec | None]:
            why = refusal(model.path)  # discovery's test: what it refuses in a folder is refused here too
            if why is not None:  # the files themselves are refused
                return None, why, 0, None
            context, kv = context_length(model.path), kv_bytes_per_token(model.path)
            embedding = read_embedding_spec(model.path)
            if embedding is not None:
                context = embedding.max_tokens
            try:
                return context, estimate_weight_bytes(model.path), kv, embedding
            except (WeightsError, FileRefused) as exc:  # changed since refusal() looked
                return context, str(exc), kv, embedding

        try:
            context, size, kv, embedding = await off_loop(read, MODEL_FILES_TIMEOUT, f"reading {model.id}'s files")
        except OffLoopTimeout as exc:
            size, context, kv, embedding = f"{exc} (a slow disk, or not a plain file?)", None, 0, None
        except OSError as exc:  # out of descriptors, a vanished folder: not the files' fault
            raise _ReadFailed(f"model {model.id!r}: cannot read {model.path}: {exc}", code="model_unreadable",
                              http_status=503, retry_after=1) from None
        self._context[model.id] = context or -1
        self._embedding[model.id] = embedding
        self._kv[model.path] = kv
        if isinstance(size, int):
            self._estimates[model.path] = size
            return
        self._estimates[model.path] = 0
        if (model.path, size) not in self._refused:  # said once, counted once
            self._refused.add((model.path, size))
            self.pool.counters["model_files_refused"] += 1
            log.error("Model %s: cannot read %s: %s", model.id, model.path, size)
            self.emit("refused", f"cannot read {model.path}: {size}", model_id=model.id)
        raise ModelUnreadable(f"model {model.id!r} cannot be loaded from {model.path}: {size}")

    def server_status(self, recent_events: int = 20) -> ServerStatus:
        now = time.monotonic()
        models = [self._model_info(m, now) for m in self.config.models]
        counters = self.counters()
        return ServerStatus(
            pid=os.getpid(), uptime=time.monotonic() - self.started, runtime_dir=str(self.runtime_dir),
            pub=self.endpoints.pub, http=self.http_address, guard=self.enforcer.status(),
            models=models, events=list(self.events)[-recent_events:], malformed_frames=self.bus.malformed_total,
            counters=counters, disk_cache=self.disk_cache(),
        )

    def disk_cache(self) -> DiskCacheStatus:
        """H5, H6 (proposed): the prompt cache's disk tier and shrink before drop, as workers reported them."""
        g = self.config.guard
        return self.pool.caches.status(int(g.disk_cache_max), self.pool.save_grace(), g.cache_quantize_bits)

    def counters(self) -> dict[str, int]:
        """Pool, gate and guard counters, for status and metrics."""
        counters = dict(self.pool.counters)
        counters.update(gate_rejected_full=self.gate.rejected_full, gate_rejected_deadline=self.gate.rejected_deadline,
                        gate_depth=self.gate.depth, guard_ticks=self.enforcer.ticks,
                        pub_subscribers=self.bus.subscribers.connected,
                        pub_subscribers_refused=self.bus.subscribers.refused)
        return counters

    def last_tick(self):
        return self.enforcer.last

    def last_snapshot(self):
        return self.enforcer.last_snapshot

    @property
    def admission_paused(self) -> bool:
        return self.enforcer.admission_paused

    def workers(self) -> list[WorkerHandle]:
        return list(self.pool.handles.values())

    def malformed_frames(self) -> dict[tuple[str, str], int]:
        return {key: count for key, count in self.bus.malformed.items()}

    def add_event_hook(self, hook: Callable[[p.GuardEvent], None]) -> None:
        self.event_hooks.append(hook)

    def subscribe(self, topics: frozenset[str], *, since: float | None = None,
                  after_id: int | None = None) -> Subscription:
        """issue 15: a bounded queue of PUB messages for one GET /v1/events client."""
        return self.hub.subscribe(topics, since=since, after_id=after_id)

    def update_guard(self, update: p.GuardUpdate) -> None:
        self.enforcer.update_guard(update)

    def start_drill(self, request: p.DrillRequest) -> str:
        """A fire drill (or its end) on a loaded model; ServeError when it cannot run."""
        if not self.config.supervisor.allow_drills:
            raise ServeError("fire drills are off; start the supervisor with --allow-drills",
                             code="drills_disabled", http_status=403)
        handle = self.pool.worker_for(self.model_config(request.model).id)
        if handle is None or not handle.serving:
            raise ServeError(f"{request.model} is not loaded; load it first", code="model_not_loaded",
                             http_status=409)
        if request.stop:
            self.pool.command(handle, p.DrillStop())
            return f"drill on {request.model} stopped"
        if request.rate <= 0 or request.to <= 0:
            raise ServeError("rate and size must be positive", code="invalid_request", http_status=400)
        self.pool.command(handle, p.Drill(rate=request.rate, to=request.to))
        self.emit("drill", f"fire drill: {request.rate} B/s up to {request.to} B", worker_id=handle.worker_id,
                  model_id=request.model)
        log.warning("fire drill on %s: growing %d B/s up to %d B", request.model, request.rate, request.to)
        return f"drill started on {request.model} (worker pid {handle.pid})"

    def _record_http_address(self) -> None:
        """Clients find the front door in endpoints.json (port 0 picks a free one)."""
        if self.endpoints.http != self.http_address:
            self.endpoints = msgspec.structs.replace(self.endpoints, http=self.http_address)
            self.endpoints.save(self.runtime_dir)

    # -- control socket ------------------------------------------------------------------

    def on_control(self, identity: bytes, msg) -> None:
        self.loop.create_task(self._control(identity, msg))

    async def _control(self, identity: bytes, msg) -> None:
        from supervisor.control import handle_control

        try:
            reply = await handle_control(self, msg)
        except Exception as exc:  # a bug must still answer the CLI, not leave it waiting
            log.exception("control request %s failed", type(msg).__name__)
            reply = p.ControlError(code="internal_error", message=f"the supervisor failed: {exc!r}", http_status=500)
        self.bus.send_control_reply(identity, reply)

    # -- reload (SIGHUP, `reload`) -------------------------------------------------------

    async def _reload_quietly(self) -> None:
        try:
            log.info("SIGHUP: %s", await self.reload("SIGHUP"))
        except ServeError as exc:
            log.error("SIGHUP: %s", exc)
        except Exception:  # never a reload that vanishes without a word
            log.exception("SIGHUP: the reload failed")

    async def reload(self, why: str) -> str:
        """Re-read the config and the models folders; apply what changed, keep what runs.

        A config that does not validate is refused whole and the old one stays.
        New models appear; removed ones are drained and stopped; pinned, ttl and
        max_concurrency of a running model change in place; a changed path
        restarts only that model. Each change is an event with its reason."""
        if self.reload_config is None:
            raise ServeError("this supervisor has no config file to re-read", code="reload_unsupported",
                             http_status=409)
        if self._reload_since is not None:
            raise ServeError(f"a reload is still reading the config and the models folders (for "
                             f"{time.monotonic() - self._reload_since:.0f} s); try again when it has finished",
                             code="reload_busy", http_status=409)
        new = await self._read_config(why)
        self._discovered_refused = last_refused()  # what that build's scan refused
        changes = self._apply_models(new) + self._apply_settings(new)
        self.config = new
        self.pool.config = new
        self.enforcer.config = new
        self._estimates.clear()
        self._kv.clear()
        self._context.clear()
        self._embedding.clear()
        self._say_refused()
        summary = "; ".join(changes) if changes else "no change"
        self.emit("reload", f"{why}: {summary}")
        self._read_all(new)
        self.wake()
        return f"configuration reloaded: {summary}"

    async def _read_config(self, why: str) -> Config:
        """The new config, read and scanned on a thread (issue 21: a rescan of
        150,000 folders on the loop blocked it past the heartbeat window). The
        loop runs on meanwhile; the reload is applied when the read completes,
        or refused, the running config kept, past RELOAD_TIMEOUT."""
        assert self.reload_config is not None
        build = self.reload_config
        config_file = self.config_file

        def read() -> Config:
            if config_file is not None:  # bounded here; the parser reads what it is given
                try:
                    open_regular(config_file, CONFIG_FILE_MAX).close()
                except FileRefused as exc:
                    raise ConfigError(str(exc)) from None
                except OSError:
                    pass  # missing or unreadable: the loader says so in its own words
            return build()

        def ended_late() -> None:
            self._reload_since = None

        self._reload_since = time.monotonic()
        late = False
        try:
            return await off_loop(read, RELOAD_TIMEOUT, "re-reading the config", on_late=ended_late)
        except OffLoopTimeout as exc:
            late = True
            words = f"{exc}; the running config stays"
            code: ErrorCode = "reload_timeout"
            status = 504
        except ConfigError as exc:
            words = f"{exc}; the running config stays"
            code, status = "invalid_config", 400
        except Exception as exc:  # a bug or an unforeseen file: refused, said, never dropped
            log.exception("reload: reading the config failed")
            words = f"reading it failed: {exc!r}; the running config stays"
            code, status = "invalid_config", 400
        finally:
            if not late:
                self._reload_since = None
        self.pool.counters["reloads_refused"] += 1
        self.emit("reload_refused", f"{why}: {words}")
        raise ServeError(f"configuration refused: {words}", code=code, http_status=status)

    def _apply_models(self, new: Config) -> list[str]:
        old = {m.id: m for m in self.config.models}
        fresh = {m.id: m for m in new.models}
        changes: list[str] = []
        for model_id in fresh.keys() - old.keys():
            changes.append(f"added {model_id}")
            self.emit("model_added", f"new in the config: {fresh[model_id].path}", model_id=model_id)
            if fresh[model_id].pinned:
                self.loop.create_task(self._load_quietly(model_id, "pinned model added by a reload"))
        for model_id in old.keys() - fresh.keys():
            changes.append(f"removed {model_id}")
            self._retire(model_id, "removed from the config")
        for model_id in old.keys() & fresh.keys():
            before, after = old[model_id], fresh[model_id]
            if before == after:
                continue
            if before.path != after.path:
                changes.append(f"restarted {model_id} (path changed)")
                loaded = self.pool.worker_for(model_id) is not None
                self._retire(model_id, f"its path changed to {after.path}", then_load=after.pinned or loaded)
                continue
            words = ", ".join(f"{key} {getattr(before, key)!r} -> {getattr(after, key)!r}"
                              for key in ("pinned", "ttl", "max_concurrency", "max_queue", "aliases")
                              if getattr(before, key) != getattr(after, key))
            changes.append(f"changed {model_id} ({words})")
            handle = self.pool.worker_for(model_id)
            if handle is not None:
                handle.model = after  # pinned and ttl are read from it; P8 walks toward the new maximum
                handle.concurrency = min(handle.concurrency, after.max_concurrency)
            elif after.pinned:
                self.loop.create_task(self._load_quietly(model_id, "pinned by a reload"))
            self.emit("model_changed", words, model_id=model_id)
        return changes

    def _retire(self, model_id: str, why: str, *, then_load: bool = False) -> None:
        """Drain and stop the model's worker (if any); load it afresh after, when asked."""
        handle = self.pool.worker_for(model_id)
        self.emit("model_removed" if not then_load else "model_changed", why, model_id=model_id)
        if handle is None:
            if then_load:
                self.loop.create_task(self._load_quietly(model_id, why))
            return
        stopping = self.pool.stop(handle, why, cause="unload")
        if then_load:
            stopping.add_done_callback(lambda _t: self.loop.create_task(self._load_quietly(model_id, why)))

    def _apply_settings(self, new: Config) -> list[str]:
        changes: list[str] = []
        keep = self.enforcer.settings.pressure_reclaim_disabled
        if guard_settings(new) != guard_settings(self.config):
            # the file's settings replace runtime changes made with /admin/guard (T6)
            self.enforcer.settings = guard_settings(new, pressure_reclaim_disabled=keep)
            changes.append("guard settings changed")
        old_s, new_s = msgspec.structs.asdict(self.config.supervisor), msgspec.structs.asdict(new.supervisor)
        live = {"idle_timeout", "models_dirs", "admin_token", "queue_deadline", "restart_max", "restart_period",
                "stop_grace", "heartbeat_timeout", "load_timeout", "max_body", "host_name"}
        stale = sorted(k for k in old_s if old_s[k] != new_s[k] and k not in live)
        if stale:
            log.warning("reload: %s take effect only after a restart", ", ".join(f"supervisor.{k}" for k in stale))
            changes.append("needs a restart for " + ", ".join(f"supervisor.{k}" for k in stale))
        return changes


class _ReadFailed(LoadError):
    """A model's files could not be read for a passing reason (an OSError such as
    EMFILE), as opposed to files that were read and refused."""


def returned(handle: WorkerHandle) -> str:
    """What a worker's exit gave back: its last measured usage, once its pid is gone.

    The ledger slot is cleared at exit, so the group's usage no longer counts
    it; a pid that is still there (a zombie not reaped, or a process that
    ignored its kill) is said, because the OS has not taken its memory back."""
    usage = handle.sample.memory.usage if handle.sample is not None else 0
    if pid_alive(handle.pid):
        return f"pid {handle.pid} is STILL PRESENT: its {format_size(usage)} may not have come back"
    return f"returned {format_size(usage)} (pid {handle.pid} gone)"
