"""Per-model readiness: what a router in front of several hosts reads to pick one.

Memory is a per-host resource, so each host runs its own supervisor and a
router (LiteLLM, an Inference-Extension endpoint picker, a script) chooses
among them per request. It needs, per model and cheaply, the answer to "if I
send this host a request now, what happens?". `assess` gives it in one
struct, from facts the supervisor already holds (no I/O but one footprint read
of a loading worker): `GET /health?model=ID`, each `/v1/models` card and the
refusals of a request that will not wait all say the same thing.

States and what a request sent now meets:

  ready         loaded, a slot free: served at once                         200
  busy          loaded, every slot taken, room in its queue: it waits there  200
  unloaded      not loaded, fits: the request loads it first                 200
  saturated     max_concurrency running and max_queue waiting                429
  loading       a load in progress (progress: bytes, elapsed, eta)           503
  paused        memory pressure paused admission (SPEC P3)                   503
  unresponsive  the worker has not answered a ping for a while (stopped?)    503
  draining      its worker is on its way out; the next one loads afresh      503
  failed        marked failed after repeated crashes (Retry-After: next try) 503
  does_not_fit  not loaded and would be refused (SPEC A3)                    507
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Literal

import msgspec

from shared import probe
from shared.states import LOADING_STATES, SERVING_STATES
from shared.vocab import ErrorCode, LoadPhase
from supervisor.config import host_name
from supervisor.doors.views import LoadProgress
from supervisor.policy.admission import admits_request, fit_report

if TYPE_CHECKING:
    from supervisor.config import ModelConfig
    from supervisor.doors.views import ModelView, WorkerView
    from supervisor.guard.admission_queue import Gate
    from supervisor.guard.enforcer import Enforcer
    from supervisor.models.catalog import Catalog
    from supervisor.models.life import Models
    from supervisor.policy.admission import FitReport
    from supervisor.workers.pool import Pool

ReadinessState = Literal["ready", "busy", "unloaded", "saturated", "loading", "paused", "unresponsive",
                         "draining", "failed", "does_not_fit"]

# The HTTP status a request sent now would get (and GET /health?model=ID answers).
STATUS: dict[ReadinessState, int] = {"ready": 200, "busy": 200, "unloaded": 200, "saturated": 429, "loading": 503,
                                     "paused": 503, "unresponsive": 503, "draining": 503, "failed": 503,
                                     "does_not_fit": 507}
# The stable code of each refusal (the same `code` the request's error body carries).
CODES: dict[ReadinessState, ErrorCode] = {"saturated": "model_at_capacity", "loading": "model_loading",
                                          "paused": "admission_paused", "unresponsive": "worker_unresponsive",
                                          "draining": "model_unloading", "failed": "model_failed",
                                          "does_not_fit": "insufficient_memory"}

# Seconds to wait before asking again. A queue drains within a request's time
# and a router has other hosts, so a full model is retried soon; pressure is
# answered by the guard within a tick or two (SPEC P9: 1 s while under it).
RETRY_SATURATED = 1
RETRY_PAUSED = 2
RETRY_DRAINING = 2
RETRY_LOADING_UNKNOWN = 2
RETRY_LOADING_MAX = 30


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    """One model on this host, as a router sees it (see the module's table).

    `accepting`: a request sent now is served, at most after a queue or a load
    (status 200). `loaded`: its worker is up (a router prefers such a host).
    `running` and `queued`: requests at its worker's slots and waiting for one
    (in the worker, or in the memory queue of SPEC P3)."""

    model: str
    host: str
    state: ReadinessState
    status: int
    accepting: bool
    loaded: bool
    code: ErrorCode | None = None
    worker: str | None = None
    running: int = 0
    queued: int = 0
    max_concurrency: int = 0
    max_queue: int = 0
    retry_after: int | None = None
    progress: LoadProgress | None = None
    reason: str = ""


HealthStatus = Literal["ok", "loading", "failed"]


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    """GET /health: is this host up with its pinned models? 503 while one is on its way.

    `waiting`: pinned model -> why it does not serve yet (loading, respawning, a worker
    state, or `failed: ...`). `unloaded`: pinned models an admin unloaded on purpose ->
    why (left out while there are none); nothing loads them, a request would, so they keep
    the host at 200: a health check that said `loading` for them said it for good, and a
    router dropped the host."""

    status: HealthStatus
    waiting: dict[str, str]
    unloaded: dict[str, str] = {}


def load_progress(state: str, began: float, now: float, grown: int, estimate: int, *,
                  phase: LoadPhase | Literal[""] = "", bytes_read: int = 0) -> LoadProgress:
    """`grown` bytes of `estimate` taken in the `now - began` seconds so far; W6: the load's
    `phase` and the weights' `bytes_read` as the worker counts them (the ETA's base when counted)."""
    elapsed = max(0.0, now - began)
    eta = None
    done_bytes = bytes_read or grown
    if state == "loading" and estimate > 0 and done_bytes >= estimate // 10:
        done = min(1.0, done_bytes / estimate)
        eta = round(elapsed * (1.0 - done) / done, 2)
    return LoadProgress(state=state, bytes=max(0, grown), estimate_bytes=estimate, elapsed=round(elapsed, 2),
                        eta=eta, phase=phase, bytes_read=max(0, bytes_read))


def loading_retry(progress: LoadProgress | None) -> int:
    if progress is None or progress.eta is None:
        return RETRY_LOADING_UNKNOWN
    return min(RETRY_LOADING_MAX, max(1, math.ceil(progress.eta)))


def saturated(model: ModelConfig, in_flight: int) -> bool:
    """Every slot taken and the queue full: one more is a 429."""
    return in_flight >= model.max_concurrency + model.max_queue


def assess(*, model: ModelConfig, host: str, view: ModelView, worker: WorkerView | None, waiting: int,
           paused: bool, silent: float | None, progress: LoadProgress | None,
           fit: FitReport | None) -> Readiness:
    """The model's readiness from the supervisor's facts.

    `worker`: its live worker, if any; `waiting`: its requests in the memory queue (P3); `silent`: seconds its
    worker has not answered a ping when that is past the unresponsive
    threshold (None: it answers, or is inside a long engine step);
    `progress`: set while a load is in flight; `fit`: the dry run for an
    unloaded model (None when the estimate is not read yet)."""
    in_flight = worker.running + waiting if worker is not None else waiting
    running = min(in_flight, model.max_concurrency)
    state: ReadinessState
    retry: int | None = None
    reason = ""
    if progress is not None:
        state, retry = "loading", loading_retry(progress)
        reason = f"loading ({progress.state}, {progress.elapsed:.1f} s so far)"
    elif worker is not None and worker.leaving:
        state, retry, reason = "draining", RETRY_DRAINING, worker.stop_reason or "marked for unload"
    elif worker is not None and worker.serving:
        if silent is not None:
            state, retry = "unresponsive", RETRY_DRAINING
            reason = f"its worker has not answered a ping for {silent:.1f} s"
        elif saturated(model, in_flight):
            state, retry = "saturated", RETRY_SATURATED
            reason = f"{running} running and {in_flight - running} waiting (max_queue {model.max_queue})"
        elif not admits_request(paused, worker.running):
            state, retry, reason = "paused", RETRY_PAUSED, "memory pressure has paused admission (SPEC P3)"
        else:
            state = "ready" if in_flight < model.max_concurrency else "busy"
    elif worker is not None:  # live but neither serving nor loading: wedged, being killed
        state, retry, reason = "unresponsive", RETRY_DRAINING, f"its worker is {worker.state}"
    elif view.state == "failed":
        state, reason = "failed", view.reason
        retry = max(1, math.ceil(view.retry_in)) if view.retry_in >= 0 else None
    elif fit is not None and not fit.fits:
        state, reason = "does_not_fit", fit.message
    else:
        state = "unloaded"
    status = STATUS[state]
    code = (fit.error or CODES[state]) if fit is not None and state == "does_not_fit" else CODES.get(state)
    return Readiness(model=model.id, host=host, state=state, status=status, accepting=status == 200,
                     loaded=worker is not None and worker.serving, code=code,
                     worker=worker.worker_id if worker is not None else None, running=running,
                     queued=in_flight - running, max_concurrency=model.max_concurrency, max_queue=model.max_queue,
                     retry_after=retry, progress=progress, reason=reason)


def kv_utilization(kv_bytes: int, room: int | None) -> float:
    """A model's KV share of the room it may grow into, 0..1, in the sense of vLLM's
    `kv_cache_usage_perc` that an Inference-Extension picker reads.

    vLLM's KV pool is fixed, so "full" is when its blocks run out and requests
    queue; here KV grows in the group's memory, and requests queue when the
    group reaches the soft watermark (SPEC P3). So: the bytes its worker holds
    for KV (`kv_bytes`: MLX active less weights and prompt cache) over those plus
    the `room` left below the soft watermark; 1.0 when none is left. `room`
    None: the guard is off, nothing pauses admission, so 0."""
    if room is None:
        return 0.0
    if room <= 0:
        return 1.0
    kv = max(0, kv_bytes)
    return kv / (kv + room)


def share(used: int, cap: int) -> float:
    """`used` of `cap`, 0..1 (0 when there is no cap)."""
    return min(1.0, max(0, used) / cap) if cap > 0 else 0.0


class Signals:
    """The routing signals, gathered from the parts that hold the facts: the model's
    worker (the pool), its load (the models), its queue (the gate), the pressure
    (the enforcer's last tick: no probe here) and its size (the catalog)."""

    def __init__(self, *, catalog: Catalog, models: Models, pool: Pool, gate: Gate, enforcer: Enforcer) -> None:
        self.catalog = catalog
        self.models = models
        self.pool = pool
        self.gate = gate
        self.enforcer = enforcer
        self._unloaded: dict[str, tuple[float, str]] = {}  # pinned model -> (when, why) an admin unloaded it

    def note_unloaded(self, model_id: str, why: str) -> None:
        """An admin unloads a pinned model on purpose: /health says so until a load begins."""
        self._unloaded[model_id] = (time.monotonic(), why)

    def health(self) -> Health:
        """The host's health: each pinned model serving, on its way, failed, or unloaded on purpose."""
        waiting: dict[str, str] = {}
        unloaded: dict[str, str] = {}
        failed = False
        for model in self.catalog.config.models:
            if model.pinned:
                state = self._pinned(model.id)
                if state.startswith("unloaded"):
                    unloaded[model.id] = state
                elif state != "serving":
                    waiting[model.id] = state
                    failed = failed or state.startswith("failed")
        status: HealthStatus = "failed" if failed else "loading" if waiting else "ok"
        return Health(status=status, waiting=waiting, unloaded=unloaded)

    def _pinned(self, model_id: str) -> str:
        """A pinned model in /health's words: "serving", "failed: ...", "unloaded ...", or why it waits."""
        view = self.models.view(model_id)
        if view.state == "failed":
            return f"failed: {view.reason}"
        if view.state in SERVING_STATES:
            return "serving"
        life = self.models.lives.get(model_id)
        mark = self._unloaded.get(model_id)
        if mark is not None and (life is None or life.load_began <= mark[0]):  # no load began since
            return f"unloaded on purpose ({mark[1]}); a request loads it again"
        self._unloaded.pop(model_id, None)
        if view.state != "unloaded":
            return view.state  # its worker is on its way up (or out)
        if self.models.loading_since(model_id) is not None:
            return "loading"
        if life is not None and life.state == "respawning":
            return "respawning"
        return "not loaded yet"

    def readiness(self, name: str) -> Readiness:
        """What a request for the model would meet now (LoadError 404 for an unknown model)."""
        model = self.catalog.model(name)
        now = time.monotonic()
        handle = self.pool.worker_for(model.id)
        fit, snapshot, size = None, self.enforcer.last_snapshot, self.catalog.estimate(model)
        if handle is None and snapshot is not None and size > 0:  # the last tick's figures: no probe here
            fit = fit_report(snapshot, model.id, size, 0, 0)
        return assess(model=handle.model if handle is not None else model, host=host_name(self.catalog.config),
                      view=self.models.view(model.id), worker=self.pool.view(handle) if handle is not None else None,
                      waiting=self.gate.waiting_for_model(model.id), paused=self.enforcer.admission_paused,
                      silent=self.pool.watchdog.unresponsive(handle, now) if handle is not None else None,
                      progress=self.load_progress(model.id, now), fit=fit)

    def load_progress(self, model_id: str, now: float) -> LoadProgress | None:
        """How far the model's load in flight has come (None: no load in flight)."""
        began = self.models.loading_since(model_id)
        if began is None:
            return None
        handle = self.pool.worker_for(model_id)
        model = self.catalog.config.model(model_id)
        estimate = self.catalog.estimate(model) if model is not None else 0
        if handle is None or handle.state not in LOADING_STATES:
            return load_progress("queued", began, now, 0, estimate, phase="admit")
        grown = 0
        sample = handle.sample
        if handle.state == "loading" and sample is not None and sample.phase == "loading":
            grown = (probe.footprint(handle.pid) or 0) - sample.memory.usage  # since it reported, before its weights
        clock = handle.load  # W6: the phase and the weights read, as the worker's heartbeat said them
        return load_progress(handle.state, began, now, grown, estimate, phase=clock.phase if clock else "",
                             bytes_read=clock.bytes_read if clock else 0)
