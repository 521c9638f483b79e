"""The supervisor as its doors see it: `supervisor.doors.api.Supervisor`, implemented.

The HTTP front door, the control socket and the metrics call these methods
and nothing else. A request's way in: its model is looked up (404), what can
be refused before any worker exists is refused (an embedding model asked to
chat, max_tokens past the cap or the context), the model is loaded or the
request joins its load (`Models.load`), the model's slots and queue are
checked (429), the admission gate holds it while memory pressure pauses
admission (SPEC P3), and the command goes to the worker; its replies come
back on a `RequestStream`. What the doors are shown are frozen views, never
a worker's handle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from shared import protocol as p
from shared.embedding import WRONG_MODEL_KIND, EmbeddingSpec
from shared.memory import NO_READING
from shared.sizes import format_size
from supervisor.config import Config, ModelConfig
from supervisor.doors.api import UNLOAD_WHEN_IDLE
from supervisor.doors.refusals import AtCapacity, LoadError, NotReady, ServeError
from supervisor.doors.views import ModelView, WorkerView
from supervisor.guard.admission_queue import Gate
from supervisor.guard.cache_book import save_grace
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.enforcer import Enforcer
from supervisor.guard.eventlog import EventLog
from supervisor.guard.readiness import Signals, loading_retry, saturated
from supervisor.models.catalog import Catalog
from supervisor.models.life import Models
from supervisor.policy.admission import FitReport, admits_request
from supervisor.policy.status import DiskCacheStatus, ModelInfo, ServerStatus
from supervisor.wiring.bus import FrameTooLarge
from supervisor.workers.pool import Pool
from supervisor.workers.process import WorkerHandle
from supervisor.workers.streams import RequestStream, new_request_id

if TYPE_CHECKING:
    from supervisor.guard.readiness import Health, Readiness
    from supervisor.policy.pressure import TickResult
    from supervisor.policy.snapshot import Snapshot
    from supervisor.wiring.bus import Bus
    from supervisor.wiring.fanout import Hub, Subscription

log = logging.getLogger("memvisor.service")

# A request that will not wait for a load still waits this long for one, so a
# refusal it can act on (failed, does not fit) reaches it first.
LOAD_GRACE = 0.25


@dataclass(slots=True)
class Place:
    """Where this supervisor can be reached, for `status` (the arbiter fills it in as it binds)."""

    runtime_dir: Path
    started: float
    pub: str = ""
    http: str = ""  # HOST:PORT the front door bound ("" while it serves none)


def unload_refusal(model: ModelConfig, admin: bool) -> str | None:
    """Who may unload what, for every door (None: this one may).

    A pinned model is the operator's promise that it stays loaded, so only an admin
    (the admin route's own test: http/auth.py require_admin; the control socket, whose
    socket only this user can open) takes it down. Anyone else may only ask for an
    unpinned model's idle timer, which P10 would run out anyway."""
    if model.pinned and not admin:
        return (f"model {model.id!r} is pinned: only an admin may unload it (the same rule as "
                f"POST /v1/models/{model.id}/unload: the admin token, or with none set a loopback tool that sends "
                "no Origin); it stays loaded")
    return None


class Service:
    def __init__(self, config: Config, *, place: Place, catalog: Catalog, models: Models, pool: Pool,
                 enforcer: Enforcer, gate: Gate, bus: Bus, hub: Hub, eventlog: EventLog,
                 counters: SupervisorCounters, wake: Callable[[], None],
                 reload: Callable[[str], Awaitable[str]]) -> None:
        self.config = config
        self.place = place
        self.catalog = catalog
        self.models = models
        self.pool = pool
        self.enforcer = enforcer
        self.gate = gate
        self.bus = bus
        self.hub = hub
        self.eventlog = eventlog
        self.tallies = counters
        self.wake = wake
        self._reload = reload
        self.signals = Signals(catalog=catalog, models=models, pool=pool, gate=gate, enforcer=enforcer)

    # -- models --------------------------------------------------------------------

    def model_config(self, model_id: str) -> ModelConfig:
        return self.catalog.model(model_id)

    def model_view(self, name: str) -> ModelView:
        model = self.config.model(name)
        return self.models.view(model.id if model is not None else name)

    async def load(self, name: str, *, explicit: bool = False) -> WorkerView:
        return self.pool.view(await self.models.load(name, explicit=explicit))

    async def fit(self, name: str, context_tokens: int = 0) -> FitReport:
        return await self.models.fit(name, context_tokens)

    async def unload(self, name: str, reason: str = "unloaded on request", *, admin: bool) -> bool:
        """The one way a model leaves on someone's request, whichever door asks: the admin
        route, the control socket, Ollama's `keep_alive: 0` with no prompt (docs/access.md).

        `unload_refusal` says who may (a pinned model: an admin only). An admin's
        unload drains the worker now, and a pinned model unloaded so is said as such
        by /health, not as loading. Anyone else gets what their keep_alive with a prompt
        gets: the model leaves once it is idle (P10), so no one's request is cut for it.
        True when a worker was there to leave."""
        model = self.catalog.model(name)
        refused = unload_refusal(model, admin)
        if refused is not None:
            self.tallies.unload_refused += 1
            raise ServeError(refused, code="forbidden", http_status=403)
        if not admin:
            there = self.pool.worker_for(model.id) is not None
            self.keep_alive(model.id, UNLOAD_WHEN_IDLE)
            return there
        if model.pinned and self.pool.worker_for(model.id) is not None:
            self.signals.note_unloaded(model.id, reason)  # before the drain: it is not loading meanwhile
        return await self.models.unload(model.id, reason)

    async def reload(self, why: str) -> str:
        return await self._reload(why)

    # -- requests ------------------------------------------------------------------

    def check_request(self, model: ModelConfig, gen: p.Generate) -> None:
        """What can be refused before a worker exists (the prompt's length in tokens
        is checked by the worker, which tokenizes it)."""
        if self.catalog.embedding(model) is not None:  # an embedder has no chat to give
            raise ServeError(f"model {model.id!r} is an embedding model: it serves /v1/embeddings and /api/embed, "
                             "not chat, completions or generation", code=WRONG_MODEL_KIND, http_status=400)
        cap = self.config.supervisor.max_tokens
        if gen.max_tokens > cap:
            raise ServeError(f"max_tokens ({gen.max_tokens}) exceeds this server's cap of {cap} "
                             "([supervisor] max_tokens)", code="invalid_request", http_status=400)
        context = self.catalog.context(model)  # read off the loop by generate; 0: unknown
        if context > 0 and gen.max_tokens >= context:
            raise ServeError(f"max_tokens ({gen.max_tokens}) leaves no room for a prompt in the model's "
                             f"context of {context} tokens", code="context_length_exceeded", http_status=400)

    async def generate(self, model_id: str, gen: p.Generate, max_wait: float | None = None) -> RequestStream:
        """A stream of `gen` on the model's worker. `max_wait` (a router's
        X-Memvisor-Max-Wait) bounds the seconds it may wait before its worker takes
        it; past that it is refused with a 503 the router can act on (NotReady)."""
        model = self.catalog.model(model_id)
        if not self.catalog.known(model):  # its config.json is read off the loop, never here
            if self.pool.worker_for(model.id) is None:
                await self.catalog.read(model)  # the load needs it anyway
            else:  # loaded: its worker checks the context itself; read it for the next one
                self.catalog.read_soon(model)
        self.check_request(model, gen)
        return await self._submit(model, gen, max_wait)

    async def embedding_spec(self, model_id: str) -> EmbeddingSpec | None:
        """How the model embeds (its folder's sentence-transformers files, read off
        the loop once), or None for a model that generates text."""
        model = self.catalog.model(model_id)
        if not self.catalog.known(model):
            await self.catalog.read(model)
        return self.catalog.embedding(model)

    async def embed(self, model_id: str, cmd: p.Embed, max_wait: float | None = None) -> RequestStream:
        """An embedding request, under the same load, admission and gate as a generation
        (and the same bound on waiting for them, `max_wait`)."""
        if await self.embedding_spec(model_id) is None:
            raise ServeError(f"model {model_id!r} generates text; it is not an embedding model (serve a "
                             "sentence-transformers folder for embeddings)", code=WRONG_MODEL_KIND, http_status=400)
        return await self._submit(self.catalog.model(model_id), cmd, max_wait)

    async def tokens(self, model_id: str, cmd: p.Tokenize | p.Detokenize) -> p.TokensReply:
        """The model's tokenizer on request, loaded on demand like a generation
        (A2-A5); the worker answers between two steps, so the wait is at most one step."""
        handle = await self.models.load(self.catalog.model(model_id).id)
        if not handle.live:
            raise LoadError(f"the worker for {model_id!r} stopped before the request reached it",
                            code="worker_exited", http_status=503)
        cmd.request_id = cmd.request_id or new_request_id()
        try:
            return await self.pool.call(handle, cmd, self.config.supervisor.step_timeout + 5.0)
        except FrameTooLarge as exc:
            raise LoadError(f"the request is too large to hand to a worker: {exc}; send less text",
                            code="request_too_large", http_status=413) from None
        except TimeoutError:
            raise LoadError(f"the worker for {model_id!r} did not answer in time", code="worker_timeout",
                            http_status=503) from None

    async def _submit(self, model: ModelConfig, cmd: p.Generate | p.Embed,
                      max_wait: float | None = None) -> RequestStream:
        handle = await self._loaded(model, max_wait)
        self._check_room(model, handle, max_wait)
        if not admits_request(self.enforcer.admission_paused, self.pool.running(handle)):
            if max_wait is not None and max_wait <= 0:
                raise NotReady(f"memory pressure has paused admission to {model.id!r} and this request "
                               "will not wait (X-Memvisor-Max-Wait)", code="admission_paused", retry_after=2)
            await self.gate.wait(handle, max_wait)
        if not handle.live:  # it exited while we waited (load, gate): no one would end the stream
            raise LoadError(f"the worker for {model.id!r} stopped before the request reached it",
                            code="worker_exited", http_status=503)
        cmd.request_id = cmd.request_id or new_request_id()
        try:
            delivered = self.pool.command(handle, cmd)
        except FrameTooLarge as exc:
            raise LoadError(f"the request is too large to hand to a worker: {exc}; shorten the prompt",
                            code="request_too_large", http_status=413) from None
        if not delivered:
            raise LoadError(f"the worker for {model.id!r} is not reachable", code="worker_exited",
                            http_status=503)
        # No reply can arrive before this: both run in this one loop callback.
        stream = self.pool.open_request(handle, cmd.request_id)
        self.wake()
        return stream

    async def _loaded(self, model: ModelConfig, max_wait: float | None) -> WorkerHandle:
        """The model's worker once loaded; with `max_wait`, a load that takes longer goes
        on for the next request while this one is refused with its progress."""
        handle = self.pool.worker_for(model.id)
        if max_wait is None or (handle is not None and handle.serving and not handle.marked_for_unload):
            return await self.models.load(model.id)
        task = asyncio.get_running_loop().create_task(self.models.load(model.id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is the next one's
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(max_wait, LOAD_GRACE))
        except asyncio.TimeoutError:
            progress = self.signals.load_progress(model.id, time.monotonic())
            raise NotReady(f"model {model.id!r} is loading; this request will not wait for it "
                           "(X-Memvisor-Max-Wait)", code="model_loading", retry_after=loading_retry(progress),
                           progress=progress) from None

    def _check_room(self, model: ModelConfig, handle: WorkerHandle, max_wait: float | None) -> None:
        """A 429 when the model's slots and queue are full; for a request that will not
        wait, a 503 when its worker has stopped answering (a router tries another host)."""
        in_flight = self.pool.running(handle) + self.gate.waiting_for(handle)
        if saturated(handle.model, in_flight):
            self.tallies.at_capacity += 1
            raise AtCapacity(f"model {model.id!r} runs {handle.model.max_concurrency} requests and "
                             f"{in_flight - handle.model.max_concurrency} more wait (max_queue "
                             f"{handle.model.max_queue}); retry later or elsewhere", retry_after=1)
        silent = self.pool.watchdog.unresponsive(handle, time.monotonic())
        if max_wait is not None and silent is not None:
            raise NotReady(f"the worker for {model.id!r} has not answered for {silent:.1f} s",
                           code="worker_unresponsive", retry_after=2)

    def cancel(self, stream: RequestStream, reason: str = "client disconnected") -> None:
        self.pool.cancel_request(stream, reason)
        self.wake()

    def keep_alive(self, model_id: str, seconds: float) -> None:
        """Ollama's keep_alive, LM Studio's ttl: the worker's own copy of its model's
        config carries the TTL P10 reads, so it lasts until that worker stops."""
        handle = self.pool.worker_for(self.catalog.model(model_id).id)
        if handle is not None:
            handle.keep_alive(seconds)
            self.wake()

    # -- status --------------------------------------------------------------------

    def server_status(self, recent_events: int = 20) -> ServerStatus:
        now = time.monotonic()
        return ServerStatus(
            pid=os.getpid(), uptime=now - self.place.started, runtime_dir=str(self.place.runtime_dir),
            pub=self.place.pub, http=self.place.http, guard=self.enforcer.status(),
            models=[self._model_info(m, now) for m in self.config.models],
            events=self.eventlog.recent(recent_events), malformed_frames=self.bus.malformed_total,
            counters=self.counters(), disk_cache=self.disk_cache(),
        )

    def disk_cache(self) -> DiskCacheStatus:
        """H5, H6 (proposed): the prompt cache's disk tier and shrink before drop, as workers reported them."""
        guard = self.config.guard
        return self.pool.caches.status(int(guard.disk_cache_max), save_grace(guard), guard.cache_quantize_bits)

    def model_info(self, name: str) -> ModelInfo:
        return self._model_info(self.catalog.model(name), time.monotonic())

    def _model_info(self, m: ModelConfig, now: float) -> ModelInfo:
        """Everything `ps` shows of one model, worked out here only."""
        view = self.models.view(m.id)
        handle = self.pool.worker_for(m.id)
        sample = handle.sample if handle is not None else None
        memory = sample.memory if sample else NO_READING
        idle = now - handle.last_access if handle is not None and not self.pool.running(handle) else 0.0
        own = handle.model.ttl if handle is not None else m.ttl  # keep_alive sets the worker's own
        ttl = own if own is not None else (self.config.supervisor.idle_timeout or None)
        expires = None
        if ttl and handle is not None and handle.serving and not m.pinned:
            expires = max(0.0, ttl - idle)
        disk = self.pool.caches.model(m.id)  # H5: as its last worker reported it
        last = handle or self.pool.reaped.get(m.id)  # W3: its last load, timed, kept after an unload
        load = last.load if last is not None else None
        proposed, accepted = self.pool.streams.guesses.get(m.id, (0, 0))
        return ModelInfo(
            id=m.id, path=m.path, pinned=m.pinned, state=view.state, worker=view.worker, pid=view.pid,
            failed_reason=view.reason, aliases=list(m.aliases), estimated_bytes=self.catalog.estimate_soon(m),
            usage=memory.usage, mlx_active=memory.mlx_active, mlx_pool=memory.mlx_pool,
            cache_bytes=memory.cache_bytes, batch_bytes=memory.batch_bytes, batch_live_bytes=memory.batch_live_bytes,
            disk_cache_bytes=disk.bytes, disk_cache_entries=disk.entries, idle_seconds=idle, ttl=ttl, expires_in=expires,
            restarts=self.models.restarts(m.id), load_phases=dict(load.phases) if load else {},
            load_spare=load.spare if load else False, prefetched_bytes=self.models.prefetch.bytes_for(m.id),
            proposed_tokens=proposed, accepted_tokens=accepted,
        )

    def counters(self) -> dict[str, int]:
        """Pool, gate and guard counters, for status and metrics."""
        counters = self.tallies.as_dict()
        counters.update(gate_rejected_full=self.gate.rejected_full, gate_rejected_deadline=self.gate.rejected_deadline,
                        gate_depth=self.gate.depth, guard_ticks=self.enforcer.ticks,
                        pub_subscribers=self.bus.subscribers.connected,
                        pub_subscribers_refused=self.bus.subscribers.refused)
        return counters

    def readiness(self, name: str) -> Readiness:
        return self.signals.readiness(name)

    def health(self) -> Health:
        return self.signals.health()

    # -- the guard -----------------------------------------------------------------

    def update_guard(self, update: p.GuardUpdate) -> None:
        self.enforcer.update_guard(update)

    def start_drill(self, request: p.DrillRequest) -> str:
        """A fire drill (or its end) on a loaded model; ServeError when it cannot run."""
        if not self.config.supervisor.allow_drills:
            raise ServeError("fire drills are off; start the supervisor with --allow-drills",
                             code="drills_disabled", http_status=403)
        handle = self.pool.worker_for(self.catalog.model(request.model).id)
        if handle is None or not handle.serving:
            raise ServeError(f"{request.model} is not loaded; load it first", code="model_not_loaded",
                             http_status=409)
        if request.stop:
            self.pool.command(handle, p.DrillStop())
            return f"drill on {request.model} stopped"
        if request.rate <= 0 or request.to <= 0:
            raise ServeError("rate and size must be positive", code="invalid_request", http_status=400)
        self.pool.command(handle, p.Drill(rate=request.rate, to=request.to))
        # the worker's own `drill` event says it started (it may refuse): one event, not two
        log.warning("fire drill on %s: growing %s/s up to %s", request.model, format_size(request.rate),
                    format_size(request.to))
        return f"drill started on {request.model} (worker pid {handle.pid})"

    # -- what the metrics and event streams read -----------------------------------

    def add_event_hook(self, hook: Callable[[p.GuardEvent], None]) -> None:
        self.eventlog.hooks.append(hook)

    def subscribe(self, topics: frozenset[str], *, since: float | None = None,
                  after_id: int | None = None) -> Subscription:
        """A bounded queue of PUB messages for one GET /v1/events client."""
        return self.hub.subscribe(topics, since=since, after_id=after_id)

    def last_tick(self) -> TickResult | None:
        return self.enforcer.last

    def last_snapshot(self) -> Snapshot | None:
        return self.enforcer.last_snapshot

    @property
    def admission_paused(self) -> bool:
        return self.enforcer.admission_paused

    def workers(self) -> list[WorkerView]:
        return [self.pool.view(h) for h in self.pool.handles.values()]

    def malformed_frames(self) -> dict[tuple[str, str], int]:
        return {key: count for key, count in self.bus.malformed.items()}
