"""A model's life: load, unload, respawn, retry, failed.

A worker is one process; a model outlives its workers. `Models` keeps one
`ModelLife` per model, whose state moves only through the table in
`supervisor.models.model_states`, and does what each state asks:

  * a load (SPEC A): every caller for the model shares the one in flight
    (A5), loads run one at a time, admission (the enforcer) evicts idle
    models to make room or refuses with 507;
  * a pinned model whose worker exits comes back after a short backoff,
    within its restart intensity (`supervisor.workers.intensity`); past it, and for a
    model whose files its worker could not load, the model is failed, and
    tried again after a backoff that doubles (at once on an explicit load);
  * an unload drains and stops its worker.

The pool owns the workers (their processes and states); this owns what the
supervisor is doing about each model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable

from supervisor.config import Config, ModelConfig
from supervisor.doors.refusals import LoadError
from supervisor.doors.views import ModelView
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.enforcer import Enforcer
from supervisor.guard.eventlog import Emit
from supervisor.models.catalog import Catalog
from supervisor.models.model_states import ModelEvent, ModelState, model_transition
from supervisor.models.prefetch import Prefetcher
from supervisor.models.swaps import Swaps
from supervisor.policy.admission import FitReport, fit_report
from supervisor.workers import intensity
from supervisor.workers.pool import Pool
from supervisor.workers.process import WorkerHandle

log = logging.getLogger("memvisor.models")


class ModelLife:
    """What the supervisor is doing about one model, and what it remembers of it."""

    __slots__ = ("state", "load", "load_began", "due", "reason", "restarts", "failures", "last_failure")

    def __init__(self) -> None:
        self.state: ModelState = "steady"
        self.load: asyncio.Task[WorkerHandle] | None = None  # the load in flight, shared (A5)
        self.load_began = 0.0
        self.due = 0.0  # respawning: when the respawn starts; failed: when the next try is
        self.reason = ""  # failed: why
        self.restarts: list[float] = []  # respawns that count toward the restart intensity
        self.failures = 0  # times failed in a row (the backoff doubles with each)
        self.last_failure = 0.0

    def move(self, event: ModelEvent) -> ModelState:
        """The one place a model's state changes (illegal moves raise)."""
        self.state = model_transition(self.state, event)
        return self.state


class Models:
    def __init__(self, config: Config, *, catalog: Catalog, pool: Pool, enforcer: Enforcer, emit: Emit,
                 wake: Callable[[], None], counters: SupervisorCounters, running: Callable[[], bool]) -> None:
        self.config = config
        self.catalog = catalog
        self.pool = pool
        self.enforcer = enforcer
        self.emit = emit
        self.wake = wake
        self.counters = counters
        self.lives: dict[str, ModelLife] = {}
        self.running = running  # False once the supervisor shuts down: nothing respawns then
        self._load_lock = asyncio.Lock()  # A5: one model load at a time
        self.swaps = Swaps(config, pool=pool, enforcer=enforcer, emit=emit, counters=counters)  # W5
        self.prefetch = Prefetcher(config, catalog=catalog, pool=pool, enforcer=enforcer, emit=emit,
                                   counters=counters)  # W4

    def renew(self, config: Config) -> None:
        """A reload: models no longer configured are forgotten (nothing of them is due)."""
        self.config = config
        self.swaps.config = self.prefetch.config = config
        for model_id in [m for m in self.lives if config.model(m) is None]:
            del self.lives[model_id]

    def life(self, model_id: str) -> ModelLife:
        life = self.lives.get(model_id)
        if life is None:
            life = self.lives[model_id] = ModelLife()
        return life

    # -- loads (SPEC A) ------------------------------------------------------------

    async def load(self, name: str, *, explicit: bool = False, _moved: int = 0) -> WorkerHandle:
        """Ready worker for the model `name` (an id or alias); every concurrent caller shares one load (A5).

        A failed model refuses with when its next try is (Retry-After), except
        to an explicit load (HTTP load route, `load` command): that is the
        operator saying "try now"."""
        model = self.catalog.model(name)
        self.prefetch.note_request(model.id)  # W4: the sequence the prediction reads
        handle = self.pool.worker_for(model.id)
        if handle is not None and handle.serving and not handle.marked_for_unload and self.swaps.open_for(handle):
            return handle
        life = self.life(model.id)
        if life.state == "failed":
            if explicit:
                self.retry(model.id, "explicit load")
            else:
                retry = self.retry_in(model.id, time.monotonic())
                raise LoadError(f"model {model.id!r} is marked failed: {self.view(model.id).reason}",
                                code="model_failed", http_status=503,
                                retry_after=max(1, math.ceil(retry)) if retry is not None else None,
                                permanent=retry is None)
        task = life.load or self._start(model, handle)
        try:
            with self.swaps.joining(task):  # W5: this request is the worker's work until it resumes
                return await asyncio.shield(task)
        except LoadError:
            current = self.config.model(name)
            if current is None or current.path == model.path or _moved > 2:
                raise
        # a reload changed the model's path while we waited; its old worker was
        # stopped on purpose, so the request waits for the new path's
        log.info("Model %s moved to %s while a request waited for its load; loading that", model.id, current.path)
        return await self.load(name, explicit=explicit, _moved=_moved + 1)

    def _start(self, model: ModelConfig, handle: WorkerHandle | None) -> asyncio.Task[WorkerHandle]:
        """The model's load, begun: the task every caller for it awaits."""
        life = self.life(model.id)
        now = time.monotonic()
        if life.state == "respawning":  # due, or a request came first: either way this is the respawn
            self._record_restart(life, now)
            self.emit("respawn", "pinned model respawned after its worker exited", model_id=model.id)
        life.move("load")
        self.prefetch.note_load(model.id)
        task = asyncio.get_running_loop().create_task(self._load(model, handle))
        life.load, life.load_began = task, now
        self.pool.spares.load_begins()  # W1: no spare starts while a load is on its way
        task.add_done_callback(lambda _t: self._load_done(model.id, task))
        return task

    def _load_done(self, model_id: str, task: asyncio.Task) -> None:
        self.pool.spares.load_ends()
        life = self.life(model_id)
        if life.load is task:  # else a retry let go of it: the model has moved on
            life.load = None
            life.move("done")

    async def _load(self, model: ModelConfig, handle: WorkerHandle | None) -> WorkerHandle:
        try:
            return await self._load_locked(model, handle)
        except LoadError as exc:
            if exc.permanent and not model.pinned and self.config.model(model.id) == model:
                self.give_up(model.id, str(exc))  # a pinned one goes through its restart intensity
            raise

    async def _load_locked(self, model: ModelConfig, handle: WorkerHandle | None) -> WorkerHandle:
        if self.pool.worker_for(model.id) is None:
            await self.catalog.read(model)  # off the loop, bounded, before the lock
        async with self._load_lock:  # A5: one model load at a time
            self._refuse_if_shutting_down(model)
            if handle is None or not handle.live:
                handle = self.pool.worker_for(model.id)
            if handle is not None and handle.leaving is not None:
                # on its way out (pressure or unload): let it finish, then load afresh
                await self.pool.stop(handle, handle.leaving.reason or "marked for unload")
                handle = None
            if handle is None:
                serving = await self.swaps.before_admit(model)  # W5: the models in the way finish first
                await self.enforcer.admit(model)
                self.swaps.after_admit(model, serving)
                loadable = await self.catalog.loadable(model)
                self._refuse_if_shutting_down(model)
                handle = await self._new_worker(loadable)
                self.enforcer.note_load_started(handle)
                self.wake()
            handle = await self._loaded(handle)
        self.wake()
        return handle

    async def _new_worker(self, model: ModelConfig) -> WorkerHandle:
        """W1: a ready spare handed the model, else a fresh process (the load's `admit` phase ends here)."""
        began, estimate = self.life(model.id).load_began, self.catalog.estimate(model)
        spare = await self.pool.spares.take(model, began=began, estimate=estimate)
        if spare is not None:
            return spare
        self._refuse_if_shutting_down(model)
        return self.pool.spawn(model, began=began, estimate=estimate)

    async def _loaded(self, handle: WorkerHandle) -> WorkerHandle:
        """The worker once it has loaded; a spare that died while taking the model (killed,
        found wedged) is replaced by a fresh worker once, so the load and its requests go on."""
        try:
            await handle.loaded
            return handle
        except LoadError as exc:
            if exc.code != "worker_exited" or not _spare_lost(handle) or not self.running():
                raise
        log.warning("The spare that took %s %s; loading it in a fresh worker", handle.model_id, handle.exit_cause)
        fresh = self.pool.spawn(handle.model, began=handle.load.began if handle.load else 0.0,
                                estimate=self.catalog.estimate(handle.model))
        await fresh.loaded
        return fresh

    def _refuse_if_shutting_down(self, model: ModelConfig) -> None:
        """A load that waited (on the A5 lock, on admission) past the start of
        shutdown starts nothing: the shutdown has already gathered the workers
        it stops, so a worker spawned now would outlive its supervisor."""
        if not self.running():
            raise LoadError(f"not loading {model.id!r}: the supervisor is shutting down", code="shutting_down",
                            http_status=503)

    async def load_quietly(self, model_id: str, why: str) -> None:
        """A load nobody waits for (pinned, respawn, reload): a failure is said, and a
        pinned model that cannot come up is tried again within its restart
        intensity, then failed with the reason; any other waits for demand."""
        try:
            await self.load(model_id)
        except LoadError as exc:
            if exc.code == "shutting_down":
                log.info("%s not loaded (%s): %s", model_id, why, exc)
                return
            log.error("could not load %s (%s): %s", model_id, why, exc)
            model = self.config.model(model_id)
            if model is not None and model.pinned:
                self.schedule_respawn(model_id, f"load failed: {exc}")

    def load_soon(self, model_id: str, why: str) -> None:
        asyncio.get_running_loop().create_task(self.load_quietly(model_id, why))

    def loading_since(self, model_id: str) -> float | None:
        """When the model's load in flight began (None: no load in flight)."""
        life = self.lives.get(model_id)
        return life.load_began if life is not None and life.load is not None else None

    async def fit(self, name: str, context_tokens: int = 0) -> FitReport:
        """"Will it fit?": the files are read off the loop first; nothing is spawned or stopped."""
        model = self.catalog.model(name)
        await self.catalog.read(model)
        return fit_report(self.enforcer.snapshot(time.monotonic()), model.id, self.catalog.estimate(model),
                          self.catalog.kv_per_token(model), context_tokens)

    async def unload(self, name: str, reason: str = "unloaded on request") -> bool:
        model_id = self.catalog.model(name).id
        handle = self.pool.worker_for(model_id)
        if handle is None:
            return False
        self.emit("unload", reason, worker_id=handle.worker_id, model_id=model_id)
        await self.pool.stop(handle, reason, cause="unload")
        return True

    def retire(self, model_id: str, why: str, *, then_load: bool = False) -> None:
        """Drain and stop the model's worker (if any); load it afresh after, when asked (a reload)."""
        handle = self.pool.worker_for(model_id)
        self.emit("model_removed" if not then_load else "model_changed", why, model_id=model_id)
        if handle is None:
            if then_load:
                self.load_soon(model_id, why)
            return
        stopping = self.pool.stop(handle, why, cause="unload")
        if then_load:
            stopping.add_done_callback(lambda _t: self.load_soon(model_id, why))

    # -- exits, respawns and failures ----------------------------------------------

    def on_exit(self, handle: WorkerHandle) -> None:
        """A worker exited unexpectedly (or was killed as wedged, or its load aborted):
        a pinned model comes back, within the restart intensity; others wait for demand.
        A spare that died while taking a model is not the model's crash: its load goes on
        in a fresh worker (`_loaded`)."""
        if _spare_lost(handle):
            return
        if handle.pinned and self.config.model(handle.model_id) is not None:
            self.schedule_respawn(handle.model_id, handle.exit_cause)

    def schedule_respawn(self, model_id: str, cause: str) -> None:
        life = self.life(model_id)
        if not self.running() or life.state in ("respawning", "failed"):
            return
        now = time.monotonic()
        life.restarts = intensity.recent(life.restarts, now, self.config.supervisor)
        delay = intensity.respawn_delay(len(life.restarts), self.config.supervisor)
        if delay is None:
            scfg = self.config.supervisor
            self.give_up(model_id, f"{scfg.restart_max} restarts within {scfg.restart_period:.0f} s (last: {cause})")
            return
        life.move("exit")
        life.due = now + delay
        log.info("Respawning pinned model %s in %.1f s", model_id, delay)
        self.wake()

    def give_up(self, model_id: str, why: str) -> None:
        """The model is failed: its requests are refused at once with when the next try
        is, instead of each paying for a spawn; the try comes after a backoff."""
        life = self.life(model_id)
        now = time.monotonic()
        life.failures, delay = intensity.failure_backoff(life.failures, life.last_failure, now,
                                                         self.config.supervisor)
        life.move("give_up")
        life.last_failure, life.reason, life.due = now, why, now + delay
        log.error("Model %s marked failed: %s; next try in %.0f s", model_id, why, delay)
        self.emit("failed", f"{why}; next try in {delay:.0f} s", model_id=model_id)
        self.wake()

    def retry(self, model_id: str, why: str) -> None:
        """failed --retry--> steady, with a fresh restart history; a pinned model is loaded again at once."""
        life = self.lives.get(model_id)
        if life is None or life.state != "failed":
            return
        life.move("retry")
        life.due, life.load = 0.0, None  # a load still ending is not this try's
        life.restarts.clear()
        log.info("Model %s: trying again (%s)", model_id, why)
        self.emit("retry", f"failed model tried again: {why}", model_id=model_id)
        model = self.config.model(model_id)
        if model is not None and model.pinned and why != "explicit load":
            self._record_restart(life, time.monotonic())
            self.load_soon(model_id, "retry after failure")

    def next_due(self, now: float) -> float:
        """When a respawn or a retry is next due (for the loop's sleep)."""
        return min((life.due for life in self.lives.values() if life.state in ("respawning", "failed")),
                   default=now + 3600)

    def tick(self, now: float) -> None:
        """Start the respawns and retries whose backoff has passed; thrash that is over is said (W5)."""
        self.swaps.tick(now)
        self.prefetch.tick(now, loading=any(life.load is not None for life in self.lives.values()),
                           failed=set(self.failed))
        for model_id, life in list(self.lives.items()):
            if life.state == "failed" and life.due <= now:
                self.retry(model_id, "its backoff has passed")
            elif life.state == "respawning" and life.due <= now and life.load is None:
                model = self.config.model(model_id)
                if model is None:  # removed since its worker exited
                    del self.lives[model_id]
                    continue
                self._start(model, self.pool.worker_for(model_id))
                self.load_soon(model_id, "respawn")  # joins that load; says a failure and retries

    def _record_restart(self, life: ModelLife, now: float) -> None:
        life.restarts.append(now)
        self.counters.respawns += 1

    # -- what the model is ---------------------------------------------------------

    @property
    def failed(self) -> dict[str, str]:
        """Failed models, with why."""
        return {m: life.reason for m, life in self.lives.items() if life.state == "failed"}

    def retry_in(self, model_id: str, now: float) -> float | None:
        """Seconds until a failed model's next try, or None when it is not failed."""
        life = self.lives.get(model_id)
        return max(0.0, life.due - now) if life is not None and life.state == "failed" else None

    def restarts(self, model_id: str) -> int:
        """Its respawns that count toward the restart intensity."""
        life = self.lives.get(model_id)
        return len(life.restarts) if life is not None else 0

    def view(self, model_id: str) -> ModelView:
        """Its live worker's state, else `failed` with why and the next try, else `unloaded`."""
        handle = self.pool.worker_for(model_id)
        if handle is not None:
            return ModelView(id=model_id, state=handle.state, worker=handle.worker_id, pid=handle.pid)
        retry = self.retry_in(model_id, time.monotonic())
        if retry is not None:
            after = f"; next try in {retry:.0f} s (or at once on an explicit load)"
            return ModelView(id=model_id, state="failed", reason=self.lives[model_id].reason + after, retry_in=retry)
        return ModelView(id=model_id, state="unloaded")


def _spare_lost(handle: WorkerHandle) -> bool:
    """A spare handed this worker's model died before it had loaded it, unasked or found
    wedged (not stopped on purpose: a load the guard aborted stays aborted)."""
    return (handle.load is not None and handle.load.spare and not handle.load.loaded
            and (handle.leaving is None or handle.left_because("marked", "wedged")))
