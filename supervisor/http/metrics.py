"""`GET /metrics`: the guard and the front door in the Prometheus text format.

Two kinds of figures, gathered two ways:

- current values (ceiling and its components, usage, pressure level,
  per-worker memory, queue depth) are read from the supervisor when Prometheus
  scrapes, by `GuardCollector`; nothing is copied on every tick. With a
  discrete device (SPEC D6) its pool has series of its own
  (`memvisor_device_*`, `memvisor_worker_device_bytes`); without one they
  are absent, not 0;
- things that happen (guard events, requests, tokens, time to first token)
  are counted where they happen: the front door calls `Metrics` directly and
  the supervisor's guard events (SPEC S2) arrive through `on_event`.

Each front door has its own registry, so several supervisors in one process
(tests) never share or clash over series.

Public names (stable): Metrics, GuardCollector, EVENT_KINDS.
"""

from __future__ import annotations

import logging
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.vocab import FailureCode, GuardEventKind, PressureLevel
from supervisor.doors.api import Supervisor
from supervisor.doors.views import WorkerView
from supervisor.guard.readiness import kv_utilization, share

log = logging.getLogger("memvisor.metrics")

# Guard event kinds that always have a series (0 until they happen), so a
# dashboard can graph evictions before the first one.
# The event kinds whose counters exist from the start (at 0), so a rate() over them is defined.
EVENT_KINDS: tuple[GuardEventKind, ...] = ("evict", "abort", "abort_load", "reclaim", "respawn", "refused", "crash",
                                           "wedged", "ttl", "failed", "unload")

LEVELS: dict[PressureLevel, int] = {"ok": 0, "soft": 1, "hard": 2}

# Seconds; CPU-only tiny models answer in milliseconds, real ones in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A load's phases: a spare's hand-off in milliseconds, a large model's read in minutes.
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The front door's instruments, in a registry of their own."""

    def __init__(self, sup: Supervisor) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("memvisor_http_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("memvisor_request_duration_seconds",
                                 "Time from a request's arrival to the last byte of its response",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("memvisor_time_to_first_token_seconds",
                              "Time from a generation request's arrival to its first token "
                              "(includes on-demand loads and waiting in the admission queue)",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tokens = Counter("memvisor_generated_tokens", "Completion tokens generated", ["model"], registry=r)
        self.proposed = Counter("memvisor_speculative_proposed_tokens", "Speculative decoding: guessed tokens "
                                "the model checked", ["model"], registry=r)
        self.accepted = Counter("memvisor_speculative_accepted_tokens", "Speculative decoding: guessed tokens "
                                "the model chose too (part of the generated tokens)", ["model"], registry=r)
        self.outcomes = Counter("memvisor_generations", "Generation requests by outcome "
                                "(finished, cancelled by the client, or the worker's error code)",
                                ["model", "outcome"], registry=r)
        self.events = Counter("memvisor_guard_events", "Guard events (SPEC S2) by kind: evictions, aborts, "
                              "reclaims, respawns, refused loads, crashes ...", ["kind"], registry=r)
        self.load_phases = Histogram("memvisor_load_phase_seconds",
                                     "Seconds each phase of a model load took (SPEC W3), by phase and by the "
                                     "worker that loaded it: a spare handed the model, or a fresh process",
                                     ["phase", "worker"], buckets=LOAD_BUCKETS, registry=r)
        for kind in EVENT_KINDS:
            self.events.labels(kind)
        r.register(GuardCollector(sup))
        sup.add_event_hook(self.on_event)

    # -- called where things happen ---------------------------------------------

    def on_event(self, event) -> None:
        self.events.labels(event.kind).inc()
        if event.kind == "load_phases" and event.load is not None:  # W3: once per load, when it is over
            worker = "spare" if event.load.spare else "fresh"
            for phase, seconds in event.load.phases.items():
                self.load_phases.labels(phase, worker).observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model).observe(seconds)

    def finished(self, model: str, completion_tokens: int, proposed: int = 0, accepted: int = 0) -> None:
        self.tokens.labels(model).inc(completion_tokens)
        self.outcomes.labels(model, "finished").inc()
        if proposed:
            self.proposed.labels(model).inc(proposed)
            self.accepted.labels(model).inc(accepted)

    def failed(self, model: str, code: FailureCode | Literal["malformed_reply"]) -> None:
        self.outcomes.labels(model, code).inc()

    def cancelled(self, model: str) -> None:
        self.outcomes.labels(model, "cancelled").inc()

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    # -- scrape -----------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GuardCollector:
    """Current values, read from the supervisor at scrape time."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    def describe(self):
        return []  # values exist only at scrape time; no up-front description

    def collect(self):
        sup = self.sup
        last = sup.last_tick()
        yield from self._guard(last, sup.admission_paused)
        if last is not None and last.device is not None:
            yield from self._device(last)
        yield from self._workers(sup.workers())
        yield from self._disk_cache(sup.disk_cache())
        yield from self._capacity(last)
        yield from self._counters(sup.counters(), sup.malformed_frames())

    def _guard(self, last, paused: bool):
        if last is None:
            return
        c = last.ceilings
        g = GaugeMetricFamily
        yield g("memvisor_guard_enabled", "1 when the memory guard is on", value=int(c.enabled))
        yield g("memvisor_ceiling_bytes", "The ceiling in force (SPEC C5); 0 = no limit", value=c.ceiling)
        comp = g("memvisor_ceiling_component_bytes", "Candidates of the ceiling (SPEC C1-C4); 0 = not a "
                 "candidate", labels=["component"])
        binding = g("memvisor_ceiling_binding", "1 for the component that sets the ceiling (SPEC C6)",
                    labels=["component"])
        for name, value in (("static", c.static), ("dynamic", c.dynamic), ("gpu_cap", c.gpu_cap)):
            comp.add_metric([name], value)
            binding.add_metric([name], int(c.binding == name))
        yield comp
        yield binding
        yield g("memvisor_reserve_bytes", "Memory the tier leaves for the OS and other apps (SPEC T1)",
                value=c.reserve)
        marks = g("memvisor_watermark_bytes", "Soft and hard watermarks (SPEC C11)", labels=["level"])
        marks.add_metric(["soft"], c.soft)
        marks.add_metric(["hard"], c.hard)
        yield marks
        yield g("memvisor_abort_limit_bytes", "Abort limit (SPEC C10)", value=c.abort_limit)
        yield g("memvisor_usage_bytes", "Group usage: supervisor + every worker (SPEC U2)", value=last.usage)
        yield g("memvisor_pressure_level", "Pressure level (SPEC P1): 0 ok, 1 soft, 2 hard",
                value=LEVELS.get(last.level, 2))
        yield g("memvisor_emergency", "1 while in emergency (SPEC P2)", value=int(last.emergency))
        yield g("memvisor_admission_paused", "1 while new requests wait in the queue (SPEC P3)", value=int(paused))

    def _device(self, last):
        """D6: the discrete device's pool (only called when there is one)."""
        d, g = last.device, GaugeMetricFamily
        yield g("memvisor_device_total_bytes", "Memory of the discrete device (SPEC D1)", value=d.total)
        yield g("memvisor_device_ceiling_bytes", "The device ceiling in force (SPEC D3); 0 = no limit",
                value=d.ceiling)
        comp = g("memvisor_device_ceiling_component_bytes", "Candidates of the device ceiling (SPEC D3)",
                 labels=["component"])
        comp.add_metric(["device_static"], d.static)
        comp.add_metric(["device_dynamic"], d.dynamic)
        yield comp
        yield g("memvisor_device_reserve_bytes", "Device memory the tier leaves free (SPEC D2)", value=d.reserve)
        yield g("memvisor_device_usage_bytes", "The group's device bytes (SPEC D1)", value=last.device_usage)
        yield g("memvisor_device_soft_bytes", "Device soft watermark (SPEC D4)", value=d.soft)
        yield g("memvisor_device_hard_bytes", "Device hard watermark (SPEC D4)", value=d.hard)
        yield g("memvisor_device_level", "Device pressure level (SPEC D4): 0 ok, 1 soft, 2 hard",
                value=LEVELS.get(last.device_level, 2))
        yield g("memvisor_device_emergency", "1 while the device pool is in emergency (SPEC D4, P2)",
                value=int(last.device_emergency))
        per_worker = g("memvisor_worker_device_bytes", "Device bytes a worker holds (SPEC D1)",
                       labels=["model", "worker"])
        snapshot = self.sup.last_snapshot()  # the records the tick decided with (D1's bytes)
        for w in snapshot.workers if snapshot is not None else ():
            if w.state not in ("stopped", "dead"):
                per_worker.add_metric([w.model, w.worker], w.device_bytes)
        yield per_worker

    def _workers(self, workers: list[WorkerView]):
        labels = ["model", "worker"]
        usage = GaugeMetricFamily("memvisor_worker_usage_bytes", "Worker usage (SPEC U1)", labels=labels)
        active = GaugeMetricFamily("memvisor_worker_mlx_active_bytes", "MLX active memory", labels=labels)
        pool = GaugeMetricFamily("memvisor_worker_mlx_pool_bytes", "MLX pool not returned to the OS",
                                 labels=labels)
        running = GaugeMetricFamily("memvisor_worker_running_requests", "Requests the worker runs",
                                    labels=labels)
        cache = GaugeMetricFamily("memvisor_worker_prompt_cache_bytes",
                                  "The worker's prompt cache, measured (SPEC H2)", labels=labels)
        batch = GaugeMetricFamily("memvisor_worker_batch_bytes",
                                  "The decode batch's KV buffers as allocated", labels=labels)
        live = GaugeMetricFamily("memvisor_worker_batch_live_bytes",
                                 "The decode batch's live KV (its rows' own tokens)", labels=labels)
        relayouts = CounterMetricFamily("memvisor_worker_batch_relayouts",
                                        "Whole-batch copies of the decode batch (growth, compaction)",
                                        labels=labels)
        returns = CounterMetricFamily("memvisor_worker_pool_returns",
                                      "Times a worker returned MLX's pool itself, over its cap (M1)",
                                      labels=labels)
        total = spares = 0
        for h in workers:
            spares += not h.model_id and h.live  # W1: a spare worker has no model yet
            key = [h.model_id, h.worker_id]
            m = h.memory
            usage.add_metric(key, m.usage)
            active.add_metric(key, m.mlx_active)
            pool.add_metric(key, m.mlx_pool)
            running.add_metric(key, h.running)
            cache.add_metric(key, m.cache_bytes)
            batch.add_metric(key, m.batch_bytes)
            live.add_metric(key, m.batch_live_bytes)
            relayouts.add_metric(key, m.batch_relayouts)
            returns.add_metric(key, m.pool_returns)
            total += m.cache_bytes
        yield from (usage, active, pool, running, cache, batch, live, relayouts, returns)
        yield GaugeMetricFamily("memvisor_spare_workers", "Spare workers starting or waiting for a model "
                                "(SPEC W1; their memory is in the worker series with model \"\")", value=spares)
        yield GaugeMetricFamily("memvisor_prompt_cache_bytes", "All workers' prompt caches together "
                                "(SPEC H2)", value=total)
        yield GaugeMetricFamily("memvisor_prompt_cache_budget_bytes", "[guard] hot_cache_max (SPEC H2)",
                                value=int(self.sup.config.guard.hot_cache_max))

    def _disk_cache(self, d):
        """H5, H6 (proposed): the prompt cache's disk tier as workers reported it, and shrink before drop."""
        g, c = GaugeMetricFamily, CounterMetricFamily
        per_model = g("memvisor_model_disk_cache_bytes", "A model's prompt-cache entries on disk (H5), as its last "
                      "worker reported them; kept while the model is unloaded", labels=["model"])
        for model, nbytes in d.models.items():
            per_model.add_metric([model], nbytes)
        yield per_model
        yield g("memvisor_disk_cache_bytes", "Every model's prompt-cache entries on disk together (H5)", value=d.bytes)
        yield g("memvisor_disk_cache_budget_bytes", "The disk tier's budget in force ([guard] disk_cache_max; "
                "auto: sized to the free disk); 0 = off or not yet reported", value=d.budget)
        for what, help_text in (("read", "read back by requests"), ("written", "written at worker stops"),
                                ("dropped", "not written: the stop's deadline came first"),
                                ("evicted", "removed, least recently used, to stay within the budget")):
            yield c(f"memvisor_disk_cache_{what}_entries", f"Prompt-cache entries {help_text} (H5)",
                    value=getattr(d, f"{what}_entries"))
            yield c(f"memvisor_disk_cache_{what}_bytes", f"Bytes of prompt-cache entries {help_text} (H5)",
                    value=getattr(d, f"{what}_bytes"))
        yield c("memvisor_disk_cache_read_tokens", "Tokens held by the entries read back from the disk tier (H5)",
                value=d.read_tokens)
        yield c("memvisor_prompt_cache_quantized_entries", "Prompt-cache entries quantized instead of dropped (H6)",
                value=d.quantized_entries)
        yield c("memvisor_prompt_cache_quantized_bytes", "Bytes quantizing prompt-cache entries returned (H6)",
                value=d.quantized_bytes)

    def _capacity(self, last):
        """What a picker in front of several hosts reads (the Gateway API Inference
        Extension's model-server protocol asks for queued requests and KV-cache utilisation;
        these are per model, since one host serves several), with memory headroom per pool."""
        g = GaugeMetricFamily
        labels = ["model"]
        queued = g("memvisor_model_queued_requests", "Requests waiting for one of the model's slots: in its "
                   "worker's queue or the memory queue (SPEC P3) (the picker's TotalQueuedRequests)", labels=labels)
        running = g("memvisor_model_running_requests", "Requests at the model's slots", labels=labels)
        ready = g("memvisor_model_ready", "1 when a request for the model sent now would be served without a "
                  "refusal (GET /health?model=ID answers 200)", labels=labels)
        kv = g("memvisor_model_kv_cache_utilization", "The model's KV bytes over those plus the group's room "
               "below the soft watermark, 0-1; 1 = admission pauses (the picker's KVCacheUtilization)",
               labels=labels)
        prompt = g("memvisor_model_prompt_cache_utilization", "The worker's prompt cache over its share of "
                   "[guard] hot_cache_max (SPEC H2), 0-1", labels=labels)
        soft = last.ceilings.soft if last is not None else 0
        room = soft - last.usage if soft > 0 else None
        seen: set[str] = set()
        for h in self.sup.workers():
            if h.model_id in seen or not h.live or not h.model_id:  # one series a model (a spare has none)
                continue
            seen.add(h.model_id)
            r = self.sup.readiness(h.model_id)
            key = [h.model_id]
            queued.add_metric(key, r.queued)
            running.add_metric(key, r.running)
            ready.add_metric(key, int(r.accepting))
            m = h.memory
            kv_bytes = m.mlx_active - h.weight_bytes - m.cache_bytes if h.serving else 0
            kv.add_metric(key, kv_utilization(kv_bytes, room))
            prompt.add_metric(key, share(m.cache_bytes, h.cache_cap))
        yield from (queued, running, ready, kv, prompt)
        headroom = g("memvisor_memory_headroom_bytes", "Ceiling less usage, per memory pool (negative: over "
                     "the ceiling); absent while the guard sets no ceiling", labels=["pool"])
        if last is not None and last.ceilings.ceiling > 0:
            headroom.add_metric(["host"], last.ceilings.ceiling - last.usage)
        if last is not None and last.device is not None and last.device.ceiling > 0:
            headroom.add_metric(["device"], last.device.ceiling - last.device_usage)
        yield headroom

    def _counters(self, counters: dict[str, int], malformed: dict[tuple[str, str], int]):
        yield GaugeMetricFamily("memvisor_queue_depth", "Requests waiting while admission is paused (SPEC P3)",
                                value=counters.get("gate_depth", 0))
        rejected = CounterMetricFamily("memvisor_queue_rejected", "Queued requests turned away (503)",
                                       labels=["reason"])
        rejected.add_metric(["full"], counters.get("gate_rejected_full", 0))
        rejected.add_metric(["deadline"], counters.get("gate_rejected_deadline", 0))
        yield rejected
        workers = CounterMetricFamily("memvisor_workers", "Worker processes by what happened to them",
                                      labels=["what"])
        for what in ("spawned", "exits", "respawns", "wedged"):  # wedged: killed for silence
            workers.add_metric([what], counters.get(what, 0))
        yield workers
        yield CounterMetricFamily("memvisor_samples", "Worker memory samples received",
                                  value=counters.get("samples", 0))
        bad = CounterMetricFamily("memvisor_bus_malformed_frames", "Frames refused on the bus",
                                  labels=["socket", "cause"])
        for (socket, cause), n in malformed.items():
            bad.add_metric([socket, cause], n)
        yield bad
