"""A worker process: one model in MLX, driven by the supervisor.

The loop is deliberately plain: take every queued command, run one engine
step (a prefill chunk or one token for each running sequence), write the
memory sample to the ledger, publish it when due, repeat. Commands therefore
take effect at the next step boundary, which is the only place MLX memory can
be touched safely. The worker obeys; it never decides policy.

MLX is imported inside `run`, never at module level: the supervisor imports
this module to name the spawn target and must not load MLX.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq
from typing_extensions import assert_never

from shared import protocol as p
from shared.embedding import WRONG_MODEL_KIND, read_embedding_spec
from shared.ledger import Ledger
from shared.limits import Limits
from shared.memory import NO_READING
from shared.modelinfo import config_refusal
from shared.vocab import MalformedCause, SampleReason, WorkerEventKind
from worker import blas
from worker.heartbeat import Heartbeat, StepClock

if TYPE_CHECKING:  # types only: these import MLX, which loads in serve(), never at module level
    from worker.allocator import AllocatorLimits
    from worker.disk_cache import DiskTier
    from worker.drill import DrillAllocation
    from worker.embedder import Embedder
    from worker.engine import Engine
    from worker.memory import Held
    from worker.prefill import DeviceUsage

log = logging.getLogger("memvisor.worker")

PR_SET_PDEATHSIG = 1
MAX_SAVE_SECONDS = 3600.0  # a Drain asking for more is a bad frame's number, not a grace
# Tests only: seconds every engine step with work sleeps first, standing in for
# a prefill chunk that computes for a long time (the wedge and liveness tests).
STEP_DELAY_ENV = "MEMVISOR_TEST_STEP_DELAY"
LOAD_DELAY_ENV = "MEMVISOR_TEST_LOAD_DELAY"  # the same, before the model loads


def _test_step_delay(name: str = STEP_DELAY_ENV) -> float:
    try:
        return max(0.0, float(os.environ.get(name, "0")))
    except ValueError:
        return 0.0


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills us when the supervisor dies, even by SIGKILL.
    Elsewhere the loop notices the parent is gone (getppid changes)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)


def run(spec_bytes: bytes) -> None:
    """Spawn target. Exit codes: 0 drained/told to stop, 2 load failed, 3 bad spec."""
    try:
        spec = msgspec.msgpack.decode(spec_bytes, type=p.WorkerSpec)
    except msgspec.DecodeError as exc:
        print(f"memvisor worker: unusable start spec: {exc}", file=sys.stderr)
        os._exit(3)
    _die_with_parent(spec.supervisor_pid)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s worker {spec.worker_id}[{os.getpid()}]: %(message)s",
    )
    blas.preload()  # OpenBLAS before the first `import mlx.core`, so libmlx binds to it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in the terminal is the supervisor's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    worker = Worker(spec)
    try:
        code = worker.serve()
    finally:
        worker.close()
    sys.exit(code)


class Worker:
    def __init__(self, spec: p.WorkerSpec) -> None:
        self.spec = spec
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
        self.dealer.setsockopt(zmq.LINGER, 2000)
        # No ZMQ_MAXMSGSIZE here: over it libzmq drops the connection for good
        # (a connecting DEALER does not come back); the codec refuses big frames.
        self.dealer.connect(spec.commands)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.setsockopt(zmq.SNDHWM, 1000)
        self.push.connect(spec.reports)
        self.commands = p.Codec(p.CommandMsg)
        self.replies = p.Codec(p.WorkerReply)
        self.reports = p.Codec(p.WorkerReport)
        self.ledger = Ledger.attach(spec.ledger_path)
        self.limits = Limits()
        self.engine: Engine | Embedder | None = None  # an embedding model runs an Embedder
        self.drill: DrillAllocation | None = None
        self.draining = False
        self.reclaim_pending: list[p.Reclaim] = []
        self.shrink_pending: list[p.ShrinkCache] = []
        self.allocator: AllocatorLimits | None = None  # once MLX is loaded (M1, M2)
        self.send_now: SampleReason | None = None  # a reason to publish the next sample at once
        self.seq = 0
        self.last_sent = 0.0
        self._last = NO_READING  # the latest reading, sent as is in the next Sample
        self.last_level = 0
        self.phase = "starting"
        # the heartbeat thread reports the step loop's progress: a long step is work, not silence
        self.clock = StepClock()
        self.heartbeat = Heartbeat(self.ctx, spec.reports, spec.worker_id, self.clock,
                                   interval=min(1.0, spec.heartbeat_timeout / 4))
        self.step_delay = _test_step_delay()
        self.heartbeat.start()  # before MLX is imported: a stopped or stuck start or load is seen too
        self.bad_frames = 0
        self._logged_bad: set[MalformedCause] = set()
        # the prompt cache's tiers (H5, H6 as proposed)
        self.disk: DiskTier | None = None
        self.save_seconds = 0.0   # what the Drain gave for writing the cache to disk
        self.quantized = (0, 0)   # entries quantized in memory, bytes that returned
        self._reported_from: tuple[p.DiskCacheStats | None, tuple[int, int]] | None = None

    # -- wire -----------------------------------------------------------------

    def reply(self, msg: p.Msg) -> None:
        try:
            self.dealer.send(self.replies.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("supervisor not reading; dropped %s", type(msg).__name__)

    def event(self, kind: WorkerEventKind, message: str) -> None:
        self._push(p.WorkerEvent(worker_id=self.spec.worker_id, kind=kind, message=message))

    def _push(self, msg: p.Msg) -> None:
        try:
            self.push.send(self.reports.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a sample is superseded by the next one; the ledger has the latest

    # -- life -----------------------------------------------------------------

    def serve(self) -> int:
        import mlx.core as mx

        from shared.probe import gpu_kind
        from worker.allocator import AllocatorLimits
        from worker.engine import Engine, EngineError
        from worker.memory import MemorySampler, device_bytes, set_discrete_device
        from worker.prefill import DeviceUsage

        try:
            info: dict[str, int | float | str] = {
                k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
        except Exception:  # older MLX
            info = {}
        device = str(mx.default_device())
        discrete = gpu_kind(info) == "cuda" and "gpu" in device
        set_discrete_device(discrete)
        self.reply(p.Hello(worker_id=self.spec.worker_id, model_id=self.spec.model_id, pid=os.getpid(),
                           device_info=info, device=device, slot=self.spec.slot, blas=blas.preload().line()))
        self.sampler = MemorySampler()
        self.allocator = AllocatorLimits(mx, device_info=info,
                                         advise=lambda text: self.event("wired_limit", text))
        self.allocator.apply(self.limits)
        self.phase = "loading"
        self.write_sample(time.monotonic())
        started = time.monotonic()
        time.sleep(_test_step_delay(LOAD_DELAY_ENV))
        # Defence in depth: mlx_lm reads config.json whole, and a 1 GiB sparse
        # one took this worker to 2 GiB before it was killed as wedged; the supervisor
        # refuses such a model before a spawn, and so does the worker, before mlx_lm.
        try:
            refused = config_refusal(self.spec.model_path)
        except OSError:
            refused = None  # a passing failure: the loader below says it in its own words
        if refused is not None:
            log.error("cannot load %s: %s", self.spec.model_path, refused)
            self.reply(p.LoadFailed(error=refused))
            return 2
        try:
            # on a discrete device a prefill's peak is device memory: G1-G3 hold it to the device pool
            self.engine = self.load_model(DeviceUsage(self.group_device_bytes, device_bytes) if discrete else None)
        except (EngineError, OSError, ValueError) as exc:
            log.error("cannot load %s: %s", self.spec.model_path, exc)
            self.reply(p.LoadFailed(error=str(exc)))
            return 2
        if "gpu" in device and isinstance(self.engine, Engine):  # a GPU's first-use costs: paid here
            log.info("warm-up: a request alone and a group in %.2f s", self.engine.warm_up())
        self.open_disk_tier()
        self.phase = "ready"
        now = time.monotonic()
        self.reply(p.Loaded(weight_bytes=self.engine.weight_bytes, seconds=now - started,
                            usage=self.write_sample(now)))
        return self.loop()

    def load_model(self, device: DeviceUsage | None) -> Engine | Embedder:
        """A sentence-embedding folder gets the Embedder, any other the chat engine (which holds
        its prefills to the device pool on a discrete device)."""
        from worker.embedder import Embedder
        from worker.engine import Engine

        kwargs = dict(max_concurrency=self.spec.max_concurrency, chunk_seconds=self.spec.chunk_seconds)
        if read_embedding_spec(self.spec.model_path) is not None:
            return Embedder.load(self.spec.model_path, **kwargs)
        return Engine.load(self.spec.model_path, device=device, **kwargs)

    def loop(self) -> int:
        assert self.engine is not None and self.allocator is not None  # serve() set both up
        while True:
            self.take_commands(block_ms=self.idle_wait_ms())
            if os.getppid() != self.spec.supervisor_pid:
                log.error("the supervisor (pid %d) is gone; exiting so no memory is held",
                          self.spec.supervisor_pid)
                return 0
            limits = self.ledger.read_limits(self.spec.slot) or self.limits
            self.allocator.apply(limits)  # M1: only calls MLX when the limits changed
            self.clock.enter_step()
            if self.step_delay and self.engine.has_work:
                time.sleep(self.step_delay)  # tests only: a long MLX step (the GIL released, as in eval)
            # a step's tokens leave in one frame; a shallow copy types the engine's
            # events as the list[Msg] coalesce takes (a list of a narrower type is not one)
            events = p.coalesce([*self.engine.step(limits, self.group_usage)])
            self.clock.leave_step(self.engine.tokens_total)
            for ev in events:
                self.reply(ev)  # engine events are the wire's own Structs
            self.step_boundary()
            self.quantize_at_soft(limits)
            now = time.monotonic()
            usage = self.write_sample(now)
            self.maybe_send_sample(now, usage, limits)
            self.report_cache()
            # Not has_work alone: a request waiting for the supervisor's memory answer
            # leaves the engine idle, yet it runs and must end before we do.
            if self.draining and not self.engine.has_work and not self.engine.running:
                self.save_cache()
                log.info("drained; exiting")
                return 0

    def idle_wait_ms(self) -> int:
        """How long the loop may block on its socket: not at all while the
        engine has work, else until the next sample, drill piece or retry."""
        assert self.engine is not None  # called from loop(), once the model is loaded
        if self.engine.has_work:
            return 0
        now = time.monotonic()
        wait = self.spec.sample_interval
        if self.drill is not None:
            due = self.drill.next_due(now)
            if due is not None:
                wait = min(wait, due)
        retry = self.engine.next_deadline()
        if retry is not None:
            wait = min(wait, max(0.0, retry - now))
        return int(wait * 1000)

    def take_commands(self, block_ms: int) -> None:
        if block_ms and not self.dealer.poll(block_ms, zmq.POLLIN):
            return
        while True:
            try:
                frame = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.commands.decode(frame)
            if isinstance(msg, p.Malformed):
                self.bad_frames += 1
                if msg.cause not in self._logged_bad:  # a fixed key: never text the sender chose
                    self._logged_bad.add(msg.cause)
                    log.warning("ignored a bad command frame: %s", msg.reason)
                continue
            self.clock.enter_step()  # tokenizing a long prompt is work too, not silence
            self.obey(msg)
            self.clock.leave_step(self.engine.tokens_total if self.engine else 0)

    def obey(self, msg: p.CommandMsg) -> None:
        engine = self.engine
        assert engine is not None  # commands are taken once the model is loaded
        match msg:
            case p.Ping():
                self.reply(p.Pong(seq=msg.seq))
            case p.SetLimits():
                self.limits = msg.limits
            case p.Generate():
                self.submit(msg)
            case p.Embed():
                self.submit_embed(msg)
            case p.AbortRequests(request_ids=None):
                engine.abort_all(msg.reason or "aborted by the supervisor", code=msg.code)
                # A drill stands in for a runaway request: aborting the work frees it too.
                self.stop_drill(f"aborted: {msg.reason}")
            case p.AbortRequests():  # a list of ids: None matched above (mypy cannot tell the two cover it)
                for rid in msg.request_ids or ():
                    engine.abort(rid, msg.reason or "aborted by the supervisor", code=msg.code)
            case p.Reclaim():
                self.reclaim_pending.append(msg)
            case p.ShrinkCache():
                self.shrink_pending.append(msg)
            case p.MemoryAnswer():
                engine.memory_answer(msg.request_id, msg.evicted)
            case p.Drain():
                log.info("draining: %s", msg.reason or "asked by the supervisor")
                self.draining = True
                seconds = msg.save_seconds
                self.save_seconds = min(seconds, MAX_SAVE_SECONDS) if math.isfinite(seconds) and seconds > 0 else 0.0
                self.phase = "draining"
                engine.abort_queued("the model is being unloaded: " + (msg.reason or "drain"), code="model_unloading")
            case p.Drill():
                self.start_drill(msg)
            case p.DrillStop():
                self.stop_drill("stopped by command")
            case p.Tokenize() | p.Detokenize():  # answered now, between two steps
                self.answer_tokens(msg)
            case _:
                assert_never(msg)
        if isinstance(msg, (p.Drain, p.AbortRequests)):
            self.reply(p.Ack(cmd=msg.cmd))

    def answer_tokens(self, msg: p.Tokenize | p.Detokenize) -> None:
        """The model's tokenizer on request (worker/tokens.py; it never raises)."""
        from worker import tokens  # imports MLX (worker.request), which serve() has loaded by now
        from worker.engine import Engine

        if not isinstance(self.engine, Engine):  # an Embedder: its tokenizer is not a generator's
            self.reply(p.Failed(request_id=msg.request_id, code=WRONG_MODEL_KIND,
                                message="this model is an embedding model: /tokenize and /detokenize serve "
                                        "models that generate text"))
            return
        tokenizer = self.engine.tokenizer
        self.reply(tokens.tokenize(tokenizer, msg) if isinstance(msg, p.Tokenize)
                   else tokens.detokenize(tokenizer, msg))

    def submit(self, msg: p.Generate) -> None:
        if self.draining:
            self.reply(p.Failed(request_id=msg.request_id, code="model_unloading",
                                message="the model is being unloaded; retry to load it again"))
            return
        assert self.engine is not None  # commands are taken once the model is loaded
        self.engine.submit_generate(msg)  # a bad prompt fails through the next step()

    def submit_embed(self, msg: p.Embed) -> None:
        """An Embed for an embedding model; a chat model answers that it has none."""
        from worker.embedder import Embedder

        if self.draining:
            self.reply(p.Failed(request_id=msg.request_id, code="model_unloading",
                                message="the model is being unloaded; retry to load it again"))
        elif isinstance(self.engine, Embedder):
            self.engine.submit_embed(msg)
        else:
            self.reply(p.Failed(request_id=msg.request_id, code=WRONG_MODEL_KIND,
                                message="this model generates text; it is not an embedding model"))

    # -- memory ---------------------------------------------------------------

    def step_boundary(self) -> None:
        if self.allocator is not None:
            self.allocator.hold_pool()  # M1 where MLX's allocator does not bound its own pool (CUDA)
        if self.drill is not None:
            # obey what arrived during the step (an abort ends the drill)
            # before the drill grows again, as a runaway request would stop
            self.take_commands(block_ms=0)
        if self.drill is not None:
            self.drill.advance(time.monotonic())
        for shrink in self.shrink_pending:
            self.shrink_cache(shrink)
        self.shrink_pending.clear()
        if self.reclaim_pending:
            assert self.engine is not None  # called from loop(), once the model is loaded
            pending = [r for r in self.reclaim_pending if not (r.idle_only and self.engine.has_work)]
            if pending:
                freed = self.sampler.reclaim()
                for r in pending:
                    self.reclaim_pending.remove(r)
                    self.reply(p.Reclaimed(cmd=r.cmd, freed_bytes=freed))

    def shrink_cache(self, msg: p.ShrinkCache) -> None:
        """H3: drop LRU entries no request uses, return the pool, report at once.
        H6 (as proposed): with quantization on, unused entries are quantized first and
        only what that leaves over the target is dropped."""
        assert self.engine is not None  # commands are taken once the model is loaded
        chat = self.chat_engine()
        if chat is not None and self.spec.cache_quantize_bits:
            self.count_quantized(*chat.quantize_cache(self.spec.cache_quantize_bits, msg.target_bytes))
        dropped = self.engine.shrink_cache(msg.target_bytes)
        freed = self.sampler.reclaim()
        log.info("prompt cache shrunk by %d bytes toward %d (%s); pool returned %d bytes",
                 dropped, msg.target_bytes, msg.reason or "asked by the supervisor", freed)
        self.reply(p.Reclaimed(cmd=msg.cmd, freed_bytes=freed))
        self.send_now = "shrink"

    # -- the prompt cache's tiers (H5, H6 as proposed) ------------------------------

    def chat_engine(self) -> Engine | None:
        """The engine when it is a chat engine (an Embedder keeps no prompt cache); None before the load."""
        from worker.engine import Engine

        return self.engine if isinstance(self.engine, Engine) else None

    def open_disk_tier(self) -> None:
        """H5: index this model's folder (headers only) so requests can read their prefix back."""
        from worker.disk_cache import DiskTier

        chat = self.chat_engine()
        if chat is not None and self.spec.disk_cache_max and chat.endings.cacheable:
            self.disk = DiskTier.open(self.spec.model_id, Path(self.spec.model_path), self.spec.disk_cache_max)
            chat.use_disk_tier(self.disk, spill_seconds=min(self.spec.disk_cache_grace, MAX_SAVE_SECONDS))
        self.report_cache()

    def save_cache(self) -> None:
        """H5: drained, write the cache's entries within the grace the Drain gave; report, then exit."""
        chat = self.chat_engine()
        if self.disk is None or chat is None or self.save_seconds <= 0:
            return
        deadline = time.monotonic() + self.save_seconds
        try:
            done = self.disk.save(chat.prompt_cache.recent_first(), deadline, given=self.save_seconds)
        except OSError as exc:  # a full or vanished disk costs the cache, never the stop
            log.error("prompt cache not written to disk: %s", exc)
            return
        log.info("prompt cache to disk: %d entries (%d bytes) written in %.3f s of %.3f s; %d not written "
                 "(deadline)", done.written, done.written_bytes, done.seconds, self.save_seconds, done.dropped)
        self.report_cache(final=True)

    def quantize_at_soft(self, limits: Limits) -> None:
        """H6: at soft pressure, shrink unused entries before the guard has to drop them."""
        bits = self.spec.cache_quantize_bits
        if not bits or limits.soft_limit <= 0:
            return
        engine = self.chat_engine()
        if engine is None or not engine.prompt_cache.quantizable():
            return
        if self.ledger.group_usage() < limits.soft_limit:
            return
        count, returned = engine.quantize_cache(bits)
        if count:
            freed = self.sampler.reclaim()
            log.info("soft pressure: %d prompt-cache entries quantized to %d bits, %d bytes returned "
                     "(pool gave back %d)", count, bits, returned, freed)
            self.count_quantized(count, returned)
            self.send_now = "shrink"

    def count_quantized(self, count: int, returned: int) -> None:
        self.quantized = (self.quantized[0] + count, self.quantized[1] + returned)

    def report_cache(self, final: bool = False) -> None:
        """The tiers' figures to the supervisor, when they changed (and always the last one).
        Called every step: it compares two references before it builds anything."""
        base = self.disk.stats if self.disk is not None else None
        if (base, self.quantized) == self._reported_from and not final:
            return
        self._reported_from = (base, self.quantized)
        stats = msgspec.structs.replace(base or p.DiskCacheStats(), quantized_entries=self.quantized[0],
                                        quantized_bytes=self.quantized[1])
        self._push(p.CacheReport(worker_id=self.spec.worker_id, model_id=self.spec.model_id, pid=os.getpid(),
                                 stats=stats, final=final))

    def start_drill(self, msg: p.Drill) -> None:
        if not self.spec.allow_drills:
            self.reply(p.Ack(cmd=msg.cmd, ok=False, detail="drills are off (serve --allow-drills)"))
            return
        from worker.drill import DrillAllocation

        self.stop_drill("replaced by a new drill")
        self.drill = DrillAllocation(rate=msg.rate, target=msg.to, now=time.monotonic())
        self.event("drill", f"drill started: {msg.rate} B/s up to {msg.to} B")
        self.reply(p.Ack(cmd=msg.cmd))

    def stop_drill(self, why: str) -> None:
        if self.drill is not None:
            held = self.drill.release()
            self.drill = None
            self.sampler.reclaim()
            self.event("drill", f"drill released {held} B: {why}")

    def group_usage(self) -> int:
        """SPEC U2 seen from here: fresh own usage + the others' latest samples."""
        s = self.sampler.sample()
        mine = self.ledger.read_sample(self.spec.slot)
        others = self.ledger.group_usage() - (mine.memory.usage if mine else 0)
        return others + s.usage

    def group_device_bytes(self) -> int:
        """D1's fallback for the group seen from here: fresh own MLX active + pool + the others'."""
        from worker.memory import device_bytes

        mine = self.ledger.read_sample(self.spec.slot)
        others = self.ledger.group_device_bytes() - (mine.memory.mlx_active + mine.memory.mlx_pool if mine else 0)
        return others + device_bytes()

    def write_sample(self, now: float) -> int:
        """Measure once (U1, H2) and put the reading where the supervisor reads it."""
        engine = self.engine
        allocator = self.allocator
        if engine is None or allocator is None:
            s = self.sampler.sample()
        else:
            s = self.sampler.sample(_held(engine), allocator.pool_returns, allocator.pool_returned)
        running = engine.running if engine else 0
        queued = engine.queued if engine else 0
        if self.phase in ("ready", "busy"):
            self.phase = "busy" if running else "ready"
        self.ledger.write_sample(
            self.spec.slot, pid=os.getpid(), t=now, memory=s, running=running, queued=queued,
            tokens=engine.tokens_total if engine else 0, phase=self.phase,
        )
        self._last = s
        return s.usage

    def maybe_send_sample(self, now: float, usage: int, limits: Limits) -> None:
        """Steady rate, and at once when the group crosses a watermark (either way)."""
        level = 0
        if limits.hard_limit > 0:
            group = self.ledger.group_usage()
            level = (group >= limits.soft_limit) + (group >= limits.hard_watermark) + (group >= limits.hard_limit)
        if limits.device_hard > 0:  # D4: the device pool's watermarks, on the group's device bytes
            on_device = self.ledger.group_device_bytes()
            level += 4 * ((on_device >= limits.device_soft) + (on_device >= limits.device_hard))
        crossed = level != self.last_level
        self.last_level = level
        why: SampleReason = "watermark" if crossed else self.send_now or "tick"
        self.send_now = None
        if why == "tick" and now - self.last_sent < self.spec.sample_interval:
            return
        self.last_sent = now
        self.seq += 1
        engine = self.engine
        self._push(p.Sample(
            worker_id=self.spec.worker_id, model_id=self.spec.model_id, pid=os.getpid(), seq=self.seq, t=now,
            memory=self._last, running=engine.running if engine else 0, queued=engine.queued if engine else 0,
            tokens=engine.tokens_total if engine else 0, why=why,
        ))

    def close(self) -> None:
        if self.heartbeat.is_alive():
            self.heartbeat.stop()
        if self.drill is not None:
            self.drill.release()
        self.dealer.close()
        self.push.close()
        self.ctx.term()
        self.ledger.close()


def _held(engine: Engine | Embedder) -> Held:
    """What the model's engine holds for the sample: the chat engine names its decode batch too."""
    from worker.engine import Engine  # imported with MLX in serve(); a cached lookup here
    from worker.memory import Held

    return engine.held() if isinstance(engine, Engine) else Held(engine.cache_bytes, engine.cache_releasable)
