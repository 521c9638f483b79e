"""The enforcer: gathers the policy's inputs, runs it, carries its decisions out.

The policy (supervisor.policy.pressure) is pure; this is the I/O around it. Each tick:

  1. read the probes (host counters, own footprint) and every worker's
     latest sample from the ledger — no round trip to any worker;
  2. build a Snapshot and call `policy.tick`;
  3. carry the decisions out in order (commands over ZeroMQ, limits into the
     ledger, stops through the pool), logging and publishing each with its
     reason (SPEC S2);
  4. when it acted, re-measure and tick again at once (P7);
  5. publish the ceiling and the pressure, and return P9's next interval.

On macOS it also watches wired memory (M3): a worker seen in the last reading
and gone from this one has exited, and a timer re-reads the OS's wired count
5 s later (the loop never sleeps on it); what did not come back is a
`wired_stranded` event and is taken off the ceilings (supervisor.policy.wired).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import BinaryIO, Callable

import msgspec
from typing_extensions import assert_never

from shared import probe
from shared import protocol as p
from shared.ledger import Ledger
from shared.memory import NO_READING
from shared.probe import nvml
from shared.sizes import MAX_SIZE, format_size
from shared.vocab import GuardEventKind, PoolName
from shared.weights import WeightsError, estimate_weight_bytes, kv_bytes_per_token
from supervisor.config import MIN_DEVICE_CEILING, Config, ModelConfig, guard_settings
from supervisor.doors.refusals import LoadError, ModelUnreadable
from supervisor.guard.eventlog import Emit
from supervisor.policy import decisions as d
from supervisor.policy import pressure as policy
from supervisor.policy import wired as wired_policy
from supervisor.policy.admission import FitReport, admit, fit_report, prefill_room
from supervisor.policy.ceilings import Ceilings, wired_limit_advice
from supervisor.policy.snapshot import PolicyState, Snapshot, WorkerRecord
from supervisor.policy.status import GuardStatus, build_status, device_pool
from supervisor.policy.tiers import ThresholdError, check_thresholds, normalise_tier
from supervisor.wiring.bus import Bus
from supervisor.workers.pool import Pool
from supervisor.workers.process import WorkerHandle

log = logging.getLogger("memvisor.guard")

# P4's environment switch: "1" turns the reclaim grace off.
DISABLE_RECLAIM_ENV = "MEMVISOR_DISABLE_PRESSURE_RECLAIM"

_ACTS = (d.ReclaimPool, d.ShrinkHotCache, d.AbortWorkerRequests, d.AbortLoad, d.MarkForUnload, d.Stop, d.ExpireTTL)


class Enforcer:
    def __init__(self, *, config: Config, pool: Pool, bus: Bus, ledger: Ledger, emit: Emit,
                 restarts: Callable[[str], int]) -> None:
        self.config = config
        self.pool = pool
        self.bus = bus
        self.ledger = ledger
        self.emit = emit
        self.restarts = restarts  # a model's respawns within its restart intensity (supervisor.models.life)
        self.settings = guard_settings(
            config, pressure_reclaim_disabled=os.environ.get(DISABLE_RECLAIM_ENV) == "1"
        )
        self.state = PolicyState()
        self.last: policy.TickResult | None = None
        self.last_snapshot: Snapshot | None = None
        self.admission_paused = False
        self.activity_hint: float | None = None
        self.fixed_interval: float | None = None  # benchmarks: hold the seed's fixed poll
        self.trace: BinaryIO | None = None  # every snapshot as one JSON line (replay)
        self.ticks = 0
        self._last_ceiling: tuple | None = None
        self._acted: set[tuple[type, str]] = set()
        # (monotonic time, decision) of every action carried out, for benchmarks and tests
        self.executed: collections.deque = collections.deque(maxlen=1000)
        self.device_info: dict = {}  # the last CUDA/Metal device_info a worker's hello gave
        # M3 (macOS): the OS's wired count, None where there is none to watch; a test injects readings
        self.read_wired: Callable[[], int | None] = probe.read_wired
        self.wired_stranded = 0  # bytes worker exits left wired, off the ceilings until they come back
        self._wired_last: tuple[int, int, list[WorkerRecord]] | None = None  # wired, ours, the workers then
        self._wiring_said = ""  # M2: the C13 advice said once

    # -- inputs -----------------------------------------------------------------

    def snapshot(self, now: float, *, recheck: bool = False) -> Snapshot:
        self.pool.read_samples()
        host = probe.read_host_counters(int(self.config.guard.budget))
        own = probe.own_footprint() or 0
        self.ledger.write_supervisor(own, now)
        # One machine, one accelerator: any worker's device_info gives the cap
        # (read once a tick; on macOS it includes a sysctl the user may change).
        info = next((h.device_info for h in self.pool.handles.values() if h.device_info), None)
        if info:
            self.device_info = info  # remembered: the next load is admitted on the device (D5)
        info = info or self.device_info
        gpu_cap_raw, device_total = probe.host_gpu_cap(info) if info else (0, 0)
        device = self.read_device(info) if device_total else None
        workers = [self._record(h, device) for h in self.pool.handles.values()]
        spares = self.pool.spares
        self._watch_wired(workers)
        return Snapshot(
            now=now, guard=self.settings, host=host, supervisor_footprint=own, gpu_cap_raw=gpu_cap_raw,
            device_total=device.total if device else 0, device_free=device.free if device else None,
            activity_hint=self.activity_hint, recheck=recheck, workers=workers, state=self.state,
            wired_stranded=self.wired_stranded,
            spare_bytes=spares.held, spare_due=spares.due(now), loads_waiting=spares.loads_waiting,
        )

    def read_device(self, info: dict) -> nvml.DeviceReading | None:
        """D1: the device the workers run on, from NVML where it can be read, else
        from a worker's hello (its total and the free memory it saw then)."""
        uuid = info.get("uuid")
        reading = nvml.read_device(uuid=uuid if isinstance(uuid, str) and uuid else None)
        return reading if reading is not None else nvml.reading_from_device_info(info)

    def _record(self, h: WorkerHandle, device: nvml.DeviceReading | None) -> WorkerRecord:
        s = h.sample
        memory = s.memory if s else NO_READING
        gpu = _gpu_share(h)
        on_device = 0
        if device is not None and probe.gpu_kind(h.device_info) == "cuda":
            # D1: NVML's per-process bytes; else MLX active + pool as the worker measured them
            by_pid = nvml.device_bytes_for(device, h.pid) if h.pid else None
            on_device = by_pid if by_pid is not None else memory.mlx_active + memory.mlx_pool
        return WorkerRecord(
            worker=h.worker_id, model=h.model_id, state=h.state, pid=h.pid, pinned=h.pinned,
            marked_for_unload=h.marked_for_unload, last_access=h.last_access,
            running=max(s.running if s else 0, self.pool.running(h)), queued=s.queued if s else 0,
            memory=memory, gpu_bytes=gpu, device_bytes=on_device,
            max_concurrency=h.max_concurrency, concurrency=h.concurrency, ttl=h.ttl,
            restarts=self.restarts(h.model_id),
        )

    # -- wired memory (M3, macOS) ---------------------------------------------------

    def _watch_wired(self, workers: list[WorkerRecord]) -> None:
        """A worker in the last reading and not in this one has exited: its wired memory is
        checked WIRED_RETURN_SECONDS later, by a timer. Stranded memory counts until it is back."""
        wired = self.read_wired()
        if wired is None:
            self._wired_last = None
            return
        ours = sum(w.gpu_bytes for w in workers)
        self.wired_stranded = wired_policy.still_stranded(self.wired_stranded, wired, ours)
        last, self._wired_last = self._wired_last, (wired, ours, workers)
        if last is None:
            return
        present = {w.worker for w in workers}
        for w in last[2]:
            if w.worker not in present and w.gpu_bytes > 0:
                before = wired_policy.WiredBefore(worker=w.worker, model=w.model, held=w.gpu_bytes,
                                                  wired=last[0], ours=last[1])
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    continue  # a one-off snapshot outside the loop: nothing could re-read later
                loop.call_later(wired_policy.WIRED_RETURN_SECONDS, self._check_wired, before)

    def _check_wired(self, before: wired_policy.WiredBefore) -> None:
        """WIRED_RETURN_SECONDS after an exit: what did not come back is stranded (an event, and the ceilings)."""
        wired = self.read_wired()
        if wired is None:
            return
        self.pool.read_samples()
        stranded = wired_policy.stranded_after_exit(before, wired, sum(map(_gpu_share, self.pool.handles.values())))
        if not stranded:
            return
        self.wired_stranded += stranded
        reason = (f"{stranded} bytes ({format_size(stranded)}) of wired memory did not come back "
                  f"{wired_policy.WIRED_RETURN_SECONDS:g} s after {before.worker} exited; counted as other apps' "
                  f"memory (off the static ceiling and the GPU cap) until the OS returns it, which may take a reboot")
        log.error("%s", reason)
        ceiling = self.last.ceilings.ceiling if self.last is not None else 0
        self.emit("wired_stranded", reason, worker_id=before.worker, model_id=before.model, ceiling=ceiling)
        self.pool.on_change()  # the ceilings changed: tick now (P9)

    def _say_wiring(self, c: Ceilings) -> None:
        """M2: with wiring on, a kernel cap below the C13 suggestion is said once, with the sysctl line."""
        advice = wired_limit_advice(c.static, c.total, c.gpu_cap_raw) if self.settings.wire_weights else ""
        if advice and advice != self._wiring_said:
            self._wiring_said = advice
            log.warning("%s", advice)
            self.emit("warning", advice)

    # -- the tick ---------------------------------------------------------------

    def tick(self, now: float) -> float:
        """One guard tick (plus its P7 re-check); returns the next interval (P9)."""
        self._acted = set()
        result = self._run(self.snapshot(now))
        if any(isinstance(x, _ACTS) for x in result.decisions):
            result = self._run(self.snapshot(time.monotonic(), recheck=True))
        self.ticks += 1
        self._say_wiring(result.ceilings)
        self.publish(result)
        return self.fixed_interval or result.next_interval

    def _run(self, snap: Snapshot) -> policy.TickResult:
        if self.trace is not None:
            self._write_trace(snap)
        result = policy.tick(snap)
        self.state = result.state
        self.last, self.last_snapshot = result, snap
        for decision in result.decisions:
            try:
                self.execute(decision, result)
            except Exception:  # one failed action must not stop the others
                log.exception("could not carry out %s", decision)
        return result

    def execute(self, x: d.Decision, result: policy.TickResult) -> None:
        usage, ceiling = result.usage, result.ceilings.ceiling
        match x:
            case d.Warn():
                log.warning("%s", x.message)
                self.emit("warning", x.message)
            case d.LevelChanged():
                log.info("Memory pressure %s -> %s: %s", x.from_level, x.to_level, x.reason)
                self.emit("level", f"{x.from_level} -> {x.to_level}: {x.reason}", usage=usage, ceiling=ceiling)
            case d.PauseAdmission() | d.ResumeAdmission():
                self.admission_paused = isinstance(x, d.PauseAdmission)
                self.emit("admission", ("paused: " if self.admission_paused else "resumed: ") + x.reason,
                          usage=usage, ceiling=ceiling)
            case d.StartSpare():
                self.pool.spares.start(x.reason)
            case d.HandOutLimits():  # complete: the policy's limits carry each worker's cap
                self.hand_out(x)
            case _:
                handle = self.pool.handles.get(x.worker)
                if handle is not None:  # else the worker exited since the snapshot
                    self.act(x, handle, result)

    def hand_out(self, x: d.HandOutLimits) -> None:
        """T6/P8: each worker named gets its limits (a step of its cap with them); one gone since the
        snapshot is skipped, and one failing send never keeps the others from theirs."""
        handles, pool = self.pool.handles, self.pool
        for worker, _model, limits, _why, step in x.entries:
            handle = handles.get(worker)
            if handle is None:
                continue
            try:
                if step:
                    pool.set_concurrency(handle, limits)
                else:
                    pool.set_limits(handle, limits)
            except Exception:
                log.exception("could not hand %s its limits", worker)

    def act(self, x: d.WorkerDecision, handle: WorkerHandle, result: policy.TickResult) -> None:
        """Carry out a decision about one worker; each action is done once a tick (P7)."""
        match x:
            case d.ApplyLimits():  # complete: the policy's limits carry the worker's cap
                self.pool.set_limits(handle, x.limits)
                return
            case d.SetConcurrency():
                self.pool.set_concurrency(handle, x.limits)
                return
        if (type(x), x.worker) in self._acted:
            return  # the P7 re-check repeats what this tick already did: once is enough
        self._acted.add((type(x), x.worker))
        self.executed.append((time.monotonic(), x))
        log.warning("%s %s: %s", type(x).__name__, handle.worker_id, x.reason)
        usage, ceiling = result.usage, result.ceilings.ceiling

        def say(kind: GuardEventKind) -> None:
            self.emit(kind, x.reason, worker_id=handle.worker_id, model_id=handle.model_id, usage=usage,
                      ceiling=ceiling)

        match x:
            case d.ReclaimPool():
                self.pool.command(handle, p.Reclaim(reason=x.reason, idle_only=x.idle_only))
                say("reclaim")
            case d.AbortWorkerRequests():
                self.pool.command(handle, p.AbortRequests(reason=f"memory pressure: {x.reason}",
                                                          code="memory_pressure"))
                say("abort")
            case d.AbortLoad():
                self.pool.kill(handle, f"load aborted: {x.reason}", cause="load_abort")
                say("abort_load")
            case d.MarkForUnload():
                handle.mark()
                say("mark_for_unload")
            case d.Stop():
                self.evict(handle, x.reason, f"evicted: {x.reason}", usage=usage, ceiling=ceiling)
            case d.ExpireTTL():
                self.pool.stop(handle, f"TTL: {x.reason}", cause="ttl")
                say("ttl")
            case d.ShrinkHotCache():  # H3: the worker drops, reclaims, reports at once
                self.pool.command(handle, p.ShrinkCache(target_bytes=x.target_bytes, reason=x.reason))
                say("shrink_cache")
            case d.StopSpare():  # W2: the pool says it (a `spare` event)
                self.pool.spares.stop(handle, x.reason)
            case d.ApplyLimits() | d.SetConcurrency():
                pass  # handled above
            case _:
                assert_never(x)

    def _write_trace(self, snap: Snapshot) -> None:
        """The trace is a diagnostic: a full disk stops it, never the guard."""
        if self.trace is None:
            return
        try:
            self.trace.write(msgspec.json.encode(snap) + b"\n")
        except OSError as exc:
            log.error("cannot write the trace (%s); tracing stops, the guard goes on", exc)
            self.close_trace()

    def close_trace(self) -> None:
        trace, self.trace = self.trace, None
        if trace is not None:
            try:
                trace.close()
            except OSError as exc:  # the last buffered lines could not be flushed
                log.error("cannot finish the trace: %s", exc)

    # -- outputs ------------------------------------------------------------------

    def device_name(self) -> str:
        """The discrete device's name as a worker's hello gave it ("" when none did)."""
        for h in self.pool.handles.values():
            name = h.device_info.get("device_name") if h.device_info else None
            if isinstance(name, str) and name:
                return name
        return ""

    def publish(self, r: policy.TickResult) -> None:
        c = r.ceilings
        now = time.time()
        # D6: the device pool rides beside the host's (None without a device)
        device = device_pool(r, self.device_name()) if r.device is not None else None
        dk = None if device is None else (device.ceiling, device.static, device.dynamic, device.binding)
        key = (c.enabled, c.tier, c.ceiling, c.static, c.dynamic, c.gpu_cap, c.binding,
               c.hot_cache_reserved, dk)
        if key != self._last_ceiling or self.ticks % 10 == 1:
            self._last_ceiling = key
            self.bus.publish(p.CeilingMsg(t=now, enabled=c.enabled, tier=c.tier, ceiling=c.ceiling, static=c.static,
                                          dynamic=c.dynamic, gpu_cap=c.gpu_cap, binding=c.binding,
                                          soft_bytes=c.soft, hard_bytes=c.hard, reserve=c.reserve,
                                          hot_cache_max=self.settings.hot_cache_max,
                                          hot_cache_reserved=c.hot_cache_reserved, device=device))
        self.bus.publish(p.PressureMsg(
            t=now, level=r.level, usage=r.usage, soft_bytes=c.soft, hard_bytes=c.hard, ceiling=c.ceiling,
            utilization=r.usage / c.ceiling if c.ceiling > 0 else 0.0, admission_paused=self.admission_paused,
            interval=self.fixed_interval or r.next_interval, device=device,
        ))

    def status(self) -> GuardStatus:
        if self.last_snapshot is None or self.last is None:
            self.tick(time.monotonic())
        assert self.last_snapshot is not None and self.last is not None
        return build_status(self.last_snapshot, self.last, self.device_name())

    # -- runtime changes (T6) -----------------------------------------------------

    def update_guard(self, update: p.GuardUpdate) -> None:
        changes: dict[str, object] = {}
        if update.tier is not None:
            tier, known = normalise_tier(update.tier)
            if not known:
                raise ValueError(f"unknown tier {update.tier!r}: choose safe, balanced, aggressive or custom")
            try:
                check_thresholds(tier, self.settings.soft_threshold, self.settings.hard_threshold)
            except ThresholdError as exc:
                raise ValueError(f"tier {tier!r} does not fit the configured thresholds: {exc}") from None
            changes["tier"] = tier
        if update.custom_ceiling is not None:
            if not 0 <= update.custom_ceiling <= MAX_SIZE:
                raise ValueError(f"custom ceiling must be 0..{MAX_SIZE} bytes, got {update.custom_ceiling}")
            changes["custom_ceiling"] = update.custom_ceiling
        if update.custom_device_ceiling is not None:  # D2
            value = update.custom_device_ceiling
            if not 0 <= value <= MAX_SIZE:
                raise ValueError(f"custom device ceiling must be 0..{MAX_SIZE} bytes, got {value}")
            if 0 < value < MIN_DEVICE_CEILING:
                raise ValueError(f"custom device ceiling must be 0 (unset) or at least 1MiB, got {value} bytes")
            changes["custom_device_ceiling"] = value
        if update.enabled is not None:
            changes["enabled"] = update.enabled
        if not changes:
            return
        self.settings = msgspec.structs.replace(self.settings, **changes)
        words = ", ".join(f"{k}={v}" for k, v in changes.items())
        log.info("guard settings changed: %s", words)
        self.emit("guard", f"settings changed: {words}")
        self.tick(time.monotonic())  # T6: the new limits reach every worker now

    # -- loads (A) and prefill evictions (G1) -------------------------------------

    def note_load_started(self, handle: WorkerHandle) -> None:
        self.activity_hint = time.monotonic()

    def weight_bytes(self, model: ModelConfig) -> int:
        """A2's estimate, read from the weight files before loading (no MLX)."""
        try:
            return estimate_weight_bytes(model.path)
        except (WeightsError, OSError) as exc:  # 422, not "our bug" (see ModelUnreadable)
            raise ModelUnreadable(f"model {model.id!r} cannot be loaded from {model.path}: {exc}") from None

    def fit(self, model: ModelConfig, context_tokens: int = 0) -> FitReport:
        """"Will it fit?": the load's verdict now, nothing spawned or stopped."""
        return fit_report(self.snapshot(time.monotonic()), model.id, self.weight_bytes(model),
                          kv_bytes_per_token(model.path), context_tokens)

    async def admit(self, model: ModelConfig) -> None:
        """SPEC A1-A4: evict LRU idle models to make room, then admit or refuse."""
        size = self.weight_bytes(model)
        for _round in range(8):
            verdict = admit(self.snapshot(time.monotonic()), model.id, size)
            if verdict.evict:
                for worker_id in verdict.evict:
                    h = self.pool.handles.get(worker_id)
                    if h is not None and h.spare:  # W2: a spare is room, stopped before any model
                        await self.pool.spares.stop(h, f"to make room for {model.id}")
                    elif h is not None:
                        await self.evict(h, f"to make room for {model.id}: {verdict.message}",
                                         f"evicted to load {model.id}")
                continue
            if verdict.admitted:
                return
            self.emit("refused", verdict.message, model_id=model.id)
            log.warning("Refused to load %s: %s", model.id, verdict.message)
            raise LoadError(verdict.message, code=verdict.error or "insufficient_memory", http_status=507)
        raise LoadError(f"could not make room for {model.id!r}", code="insufficient_memory", http_status=507)

    def evict(self, handle: WorkerHandle, why: str, stop_reason: str, *, usage: int = 0,
              ceiling: int = 0) -> asyncio.Task:
        """Stop an idle model to make room, saying why: the one way the guard evicts,
        whether the pressure policy (P6), a load's admission (A2) or a prefill (G1) asks."""
        self.emit("evict", why, worker_id=handle.worker_id, model_id=handle.model_id, usage=usage, ceiling=ceiling)
        return self.pool.stop(handle, stop_reason, cause="evict")

    def on_need_memory(self, handle: WorkerHandle, request_id: str, need_bytes: int, pool: PoolName = "host") -> None:
        asyncio.get_running_loop().create_task(self._evict_for_prefill(handle, request_id, need_bytes, pool))

    async def _evict_for_prefill(self, handle: WorkerHandle, request_id: str, need_bytes: int, pool: PoolName) -> None:
        """G1: `need_bytes` is the worker's shortfall in `pool`; the answer goes once the victims,
        and the stops already under way that count as room, have exited."""
        snapshot = self.snapshot(time.monotonic())
        room = prefill_room(snapshot, handle.worker_id, need_bytes, pool=pool)
        held = {w.worker: w.device_bytes if pool == "device" else w.usage for w in snapshot.workers}
        where = "of the device pool's limit" if pool == "device" else "of its limit"
        for worker_id in room.stop:
            h = self.pool.handles.get(worker_id)
            if h is not None and h.spare:  # W2: a spare is stopped before any model
                await self.pool.spares.stop(h, f"to make room for a prefill on {handle.model_id}")
            elif h is not None:
                await self.evict(h, f"prefill of {request_id} on {handle.model_id} is {format_size(need_bytes)} "
                                    f"short {where}; stop idle {h.model_id} ({format_size(held.get(worker_id, 0))})",
                                 f"evicted for a prefill on {handle.model_id}")
        await self._exits(room.await_exit)
        if handle.live:
            self.pool.command(handle, p.MemoryAnswer(request_id=request_id, evicted=room.made))

    async def _exits(self, worker_ids: list[str]) -> None:
        """Wait for stops already under way to end (the stop's own escalation bounds each;
        asyncio.wait cancels none of them if this task is cancelled)."""
        waits = [h.exited for w in worker_ids if (h := self.pool.handles.get(w)) is not None and not h.exited.done()]
        if waits:
            await asyncio.wait(waits)


def _gpu_share(h: WorkerHandle) -> int:
    """A worker's GPU share of its usage (SPEC C `own_gpu`; Metal: MLX active + pool), from its last sample."""
    s = h.sample
    if s is None or not h.device_info:
        return 0
    return probe.gpu_share_of_usage(h.device_info, s.memory.mlx_active, s.memory.mlx_pool)
