"""Worker processes: spawn, watch, stop with escalation, respawn with restart intensity.

One worker process per loaded model. The pool knows processes and their
states (DESIGN.md: starting -> loading -> ready <-> busy -> draining -> stopped,
plus dead, wedged and failed); it decides nothing about memory. The enforcer
and the front door ask it to spawn and stop; it tells them, through
`on_event`, everything that happened, each with a cause people can read.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import time
from typing import Callable

import msgspec
import multiprocess

from shared import protocol as p
from shared.ledger import Ledger, LedgerSample
from shared.limits import Limits

log = logging.getLogger("memvisor.pool")

LIVE_STATES = ("starting", "loading", "ready", "busy", "draining")


class LoadError(RuntimeError):
    """A model could not be brought up; `code` is the API error code."""

    def __init__(self, message: str, code: str = "load_failed", http_status: int = 500) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status


class RequestStream:
    """One generation in flight: replies from the worker land in `queue`."""

    __slots__ = ("request_id", "model_id", "worker", "queue", "created", "first_token", "done")

    def __init__(self, request_id: str, model_id: str, worker: "WorkerHandle") -> None:
        self.request_id = request_id
        self.model_id = model_id
        self.worker = worker
        self.queue: asyncio.Queue = asyncio.Queue()
        self.created = time.monotonic()
        self.first_token: float | None = None
        self.done = False

    def put(self, msg: p.Msg) -> None:
        if self.done:
            return
        if isinstance(msg, p.TokenOut) and self.first_token is None:
            self.first_token = time.monotonic()
        if isinstance(msg, (p.Finished, p.Failed)):
            self.done = True
        self.queue.put_nowait(msg)


class WorkerHandle:
    """The supervisor's view of one worker process."""

    def __init__(self, worker_id: str, model, slot: int, generation: int) -> None:
        self.worker_id = worker_id
        self.identity = worker_id.encode()
        self.model = model
        self.model_id: str = model.id
        self.slot = slot
        self.generation = generation
        self.proc = None
        self.pid: int = 0
        self.state: str = "starting"
        self.spawned_at = time.monotonic()
        self.last_access = self.spawned_at
        self.last_pong = self.spawned_at
        self.ping_seq = 0
        self.weight_bytes = 0
        self.device_info: dict = {}
        self.loaded: asyncio.Future = asyncio.get_running_loop().create_future()
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self.requests: dict[str, RequestStream] = {}
        self.marked_for_unload = False
        self.stop_reason = ""
        self.stopping: asyncio.Task | None = None
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

    def __repr__(self) -> str:
        return f"<worker {self.worker_id} pid={self.pid} {self.state}>"


EventSink = Callable[..., None]


class Pool:
    def __init__(self, *, bus, ledger: Ledger, config, on_event: EventSink, on_change: Callable[[], None]) -> None:
        self.bus = bus
        self.ledger = ledger
        self.config = config
        self.on_event = on_event
        self.on_change = on_change  # wake the enforcer
        self.handles: dict[str, WorkerHandle] = {}
        self.by_identity: dict[bytes, WorkerHandle] = {}
        self.requests: dict[str, RequestStream] = {}
        self.restarts: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.failed: dict[str, str] = {}  # model id -> why it is not respawned
        self._generation = 0
        self._cmd = 0
        self._free_slots = list(range(ledger.n_slots))
        self._mp = multiprocess.get_context("spawn")
        self.counters: collections.Counter[str] = collections.Counter()
        self._pings: dict[tuple[str, int], asyncio.Future] = {}
        # Off only in the reaction benchmark's baseline (the seed's fixed 1 s poll).
        self.wake_on_watermark = True

    # -- lookups ------------------------------------------------------------

    def worker_for(self, model_id: str) -> WorkerHandle | None:
        """The live worker serving `model_id` (at most one)."""
        for h in self.handles.values():
            if h.model_id == model_id and h.live:
                return h
        return None

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
            allow_drills=scfg.allow_drills,
        )
        from worker.main import run as worker_main  # imports no MLX at module level

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
        self.on_event("spawn", f"started worker pid {proc.pid} to load {model.path}", handle)
        return handle

    # -- messages from workers ----------------------------------------------

    def on_reply(self, identity: bytes, msg) -> None:
        handle = self.by_identity.get(identity)
        if handle is None or not handle.live:
            self.bus.bad("commands", f"message from unknown or stopped worker {identity!r}")
            return
        if isinstance(msg, p.TokenOut | p.Finished | p.Failed):
            stream = self.requests.get(msg.request_id)
            if stream is not None:
                stream.put(msg)
                if stream.done:
                    self._finish_request(stream)
            return
        if isinstance(msg, p.Pong):
            handle.last_pong = time.monotonic()
            waiter = self._pings.pop((handle.worker_id, msg.seq), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(handle.last_pong)
        elif isinstance(msg, p.Hello):
            self._on_hello(handle, msg)
        elif isinstance(msg, p.Loaded):
            handle.weight_bytes = msg.weight_bytes
            if handle.stopping is None:  # a stop is final: a worker on its way out is never ready
                handle.state = "ready"
            handle.last_access = time.monotonic()
            handle.last_pong = handle.last_access
            if not handle.loaded.done():
                handle.loaded.set_result(True)
            log.info("Worker %s loaded %s (%.1f MB weights) in %.2f s",
                     handle.worker_id, handle.model_id, msg.weight_bytes / 1e6, msg.seconds)
            self.on_event("loaded", f"model loaded in {msg.seconds:.2f} s", handle)
            self.on_change()
        elif isinstance(msg, p.LoadFailed):
            if not handle.loaded.done():
                handle.loaded.set_exception(LoadError(f"model {handle.model_id!r} failed to load: {msg.error}"))
            handle.marked_for_unload = True
            self.on_event("load_failed", msg.error, handle)
        elif isinstance(msg, p.NeedMemory):
            self.on_event("need_memory", f"prefill of {msg.request_id} needs {msg.need_bytes} bytes", handle,
                          request_id=msg.request_id, need_bytes=msg.need_bytes)
        # Ack / Reclaimed are informational; the sample that follows carries the effect.

    def _on_hello(self, handle: WorkerHandle, msg: p.Hello) -> None:
        if msg.pid != handle.pid or msg.worker_id != handle.worker_id:
            self.bus.bad("commands", f"hello from {msg.worker_id} pid {msg.pid} does not match the spawned process")
            return
        handle.device_info = dict(msg.device_info)
        if handle.stopping is None:
            handle.state = "loading"
        handle.last_pong = time.monotonic()
        if handle.last_limits is not None:
            self.command(handle, p.SetLimits(limits=handle.last_limits))
        self.on_change()

    def on_report(self, msg) -> None:
        if isinstance(msg, p.Sample):
            handle = self.handles.get(msg.worker_id)
            if handle is None or msg.pid != handle.pid:
                self.bus.bad("reports", f"sample from unknown worker {msg.worker_id}")
                return
            self.counters["samples"] += 1
            self.bus.publish(msg)
            if msg.why in ("watermark", "shrink") and self.wake_on_watermark:
                # P9: a watermark crossing is answered now, not at the next tick; H3: so is a shrink
                self.on_change()
        elif isinstance(msg, p.WorkerEvent):
            handle = self.handles.get(msg.worker_id)
            if handle is not None:
                self.on_event(msg.kind, msg.message, handle)

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
        stream = RequestStream(request_id, handle.model_id, handle)
        self.requests[request_id] = stream
        handle.requests[request_id] = stream
        handle.last_access = time.monotonic()
        return stream

    def cancel_request(self, stream: RequestStream, reason: str) -> None:
        """The client went away: abort in the worker, forget the stream."""
        if not stream.done:
            self.command(stream.worker, p.AbortRequests(request_ids=[stream.request_id], reason=reason,
                                                        code="client_disconnected"))
            stream.done = True
        self._finish_request(stream)

    def _finish_request(self, stream: RequestStream) -> None:
        self.requests.pop(stream.request_id, None)
        stream.worker.requests.pop(stream.request_id, None)
        stream.worker.last_access = time.monotonic()

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
            if h.state in ("starting", "loading") and h.stopping is None:
                if now - h.spawned_at > scfg.load_timeout:
                    wedged.append(h)
                continue
            if h.state not in ("ready", "busy"):
                continue
            if now - h.last_pong > scfg.heartbeat_timeout:
                wedged.append(h)
                continue
            h.ping_seq += 1
            self.command(h, p.Ping(seq=h.ping_seq))
        return wedged

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

    def read_samples(self) -> None:
        for h in self.handles.values():
            if h.live:
                sample = self.ledger.read_sample(h.slot)
                if sample is not None and sample.pid == h.pid:
                    h.sample = sample
                    if h.state in ("ready", "busy"):
                        h.state = "busy" if sample.running or h.requests else "ready"

    # -- stopping -------------------------------------------------------------

    def stop(self, handle: WorkerHandle, reason: str, *, kill_now: bool = False) -> asyncio.Task:
        """Drain -> SIGTERM -> SIGKILL, each after a grace period. Idempotent."""
        if handle.stopping is not None:
            return handle.stopping
        handle.stop_reason = reason
        handle.state = "draining"
        handle.stopping = asyncio.get_running_loop().create_task(self._stop(handle, reason, kill_now))
        return handle.stopping

    async def _stop(self, handle: WorkerHandle, reason: str, kill_now: bool) -> None:
        grace = self.config.supervisor.stop_grace
        if not kill_now and self.command(handle, p.Drain(reason=reason)):
            if await self._wait_exit(handle, grace):
                return
            log.warning("Worker %s did not exit %.1f s after drain; sending SIGTERM", handle.worker_id, grace)
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

    def kill(self, handle: WorkerHandle, reason: str) -> asyncio.Task:
        """For a wedged worker (it will not obey a drain) or a second ^C (no time
        to wait for one): skip straight to signals. A stop already waiting for
        the worker to drain is hurried with SIGTERM; its escalation goes on."""
        if handle.stopping is not None and signal.SIGTERM not in handle.signals_sent:
            self._signal(handle, signal.SIGTERM)
        return self.stop(handle, reason, kill_now=True)

    # -- exits ----------------------------------------------------------------

    def _on_sentinel(self, handle: WorkerHandle) -> None:
        asyncio.get_running_loop().remove_reader(handle.proc.sentinel)
        self._reap(handle, 0)

    def _reap(self, handle: WorkerHandle, tries: int) -> None:
        """The sentinel fires as the child closes its pipe, a moment before the
        kernel has its exit status; poll briefly rather than block the loop."""
        handle.proc.join(0)
        if handle.proc.exitcode is None and tries < 200:
            asyncio.get_running_loop().call_later(0.005, self._reap, handle, tries + 1)
            return
        self._exited(handle, handle.proc.exitcode)

    def _exited(self, handle: WorkerHandle, code: int | None) -> None:
        expected = handle.stopping is not None
        handle.exit_cause = describe_exit(code, expected, handle.signals_sent)
        prior = handle.state
        handle.state = "stopped" if expected else "dead"
        if handle.state == "dead" and prior == "wedged":
            handle.state = "wedged"
        self.ledger.clear_slot(handle.slot)
        self._free_slots.append(handle.slot)
        self.by_identity.pop(handle.identity, None)
        level = logging.INFO if expected and code == 0 else logging.ERROR
        log.log(level, "Worker %s (pid %d, model %s) %s%s", handle.worker_id, handle.pid, handle.model_id,
                handle.exit_cause, f" [{handle.stop_reason}]" if handle.stop_reason else "")
        for stream in list(handle.requests.values()):
            stream.put(p.Failed(request_id=stream.request_id, code="worker_exited",
                                message=f"the worker serving {handle.model_id!r} {handle.exit_cause}"))
            self._finish_request(stream)
        if not handle.loaded.done():
            handle.loaded.set_exception(
                LoadError(f"worker for {handle.model_id!r} {handle.exit_cause} before the model was loaded"))
        if not handle.exited.done():
            handle.exited.set_result(code)
        self.handles.pop(handle.worker_id, None)
        self.counters["exits"] += 1
        self.on_event("exit" if expected else "crash", handle.exit_cause, handle, exitcode=code)
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
        tasks = [self.stop(h, reason) for h in list(self.handles.values()) if h.proc is not None]
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
