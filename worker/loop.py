"""A worker's life once its process is set up: load the model, then the step loop.

The loop is deliberately plain: take every queued command, run one engine
step (a prefill chunk or one token for each running sequence), write the
memory sample to the ledger, publish it when due, repeat. Commands therefore
take effect at the next step boundary, which is the only place MLX memory can
be touched safely. The worker obeys; it never decides policy.

The commands are obeyed here, beside the loop, because they change what the
loop reads at its next turn (limits, the drain, pending reclaims and shrinks,
the drill); what has state of its own lives apart: the sockets (worker/wire.py),
the memory reading (worker/readings.py) and the prompt cache's tiers
(worker/cache_tiers.py).

MLX is imported inside `serve`, never at module level: the spawn target
(worker/main.py) imports this module, and the supervisor imports that one.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import zmq
from typing_extensions import assert_never

from shared import protocol as p
from shared.embedding import WRONG_MODEL_KIND, read_embedding_spec
from shared.ledger import Ledger
from shared.limits import Limits
from shared.modelinfo import config_refusal
from shared.vision_families import is_vision_model
from worker import blas
from worker.heartbeat import Heartbeat, StepClock
from worker.wire import Wire

if TYPE_CHECKING:  # types only: these import MLX, which loads in serve(), never at module level
    from worker.allocator import AllocatorLimits
    from worker.drill import DrillAllocation
    from worker.embedder import Embedder
    from worker.engine import Engine
    from worker.loader import LoadMeter
    from worker.prefill import DeviceUsage

log = logging.getLogger("memvisor.worker")

# An idle worker woken by a request waits this long for the next one before its first step,
# and at most BURST_SECONDS in all (gather_burst says why).
BURST_QUIET_MS = 15
BURST_SECONDS = 0.05
# Tests only: seconds every engine step with work sleeps first, standing in for
# a prefill chunk that computes for a long time (the wedge and liveness tests).
STEP_DELAY_ENV = "MEMVISOR_TEST_STEP_DELAY"
LOAD_DELAY_ENV = "MEMVISOR_TEST_LOAD_DELAY"  # the same, before the model loads


def delay_for_tests(name: str = STEP_DELAY_ENV) -> float:
    try:
        return max(0.0, float(os.environ.get(name, "0")))
    except ValueError:
        return 0.0


class Worker:
    def __init__(self, spec: p.WorkerSpec, started: float = 0.0) -> None:
        self.spec = spec
        self.started = started or time.monotonic()  # W3: when the process entered the worker's code
        self.ctx = zmq.Context()
        self.wire = Wire(self.ctx, spec)
        self.ledger = Ledger.attach(spec.ledger_path)
        self.limits = Limits()
        self.engine: Engine | Embedder | None = None  # an embedding model runs an Embedder
        self.drill: DrillAllocation | None = None
        self.draining = False
        self.reclaim_pending: list[p.Reclaim] = []
        self.shrink_pending: list[p.ShrinkCache] = []
        self.allocator: AllocatorLimits | None = None  # once MLX is loaded (M1, M2)
        self.device = ""  # where MLX computes (mx.default_device()), once prepared
        self.discrete = False  # ... and whether that is a discrete device (SPEC D)
        # the heartbeat thread reports the step loop's progress: a long step is work, not silence
        self.clock = StepClock()
        self.heartbeat = Heartbeat(self.ctx, spec.reports, spec.worker_id, self.clock,
                                   interval=min(1.0, spec.heartbeat_timeout / 4))
        self.step_delay = delay_for_tests()
        if not spec.spare:  # W6: a fresh worker's load is under way from its first heartbeat (its imports)
            self.clock.load_phase = "hello"
        self.heartbeat.start()  # before MLX is imported: a stopped or stuck start or load is seen too

    # -- life -----------------------------------------------------------------

    def serve(self) -> int:
        """Import MLX and the engine and say hello; a spare then waits for its model
        (SPEC W1); load the model, say so, and run the loop. 2 when the model cannot be loaded."""
        self.prepare()
        if self.spec.spare:
            taken = self.wait_as_spare()
            if taken is None:
                return 0  # drained (or its supervisor is gone) before any load named it
            self.spec = self.readings.spec = taken
        return self.load()

    def prepare(self) -> None:
        """Everything that does not depend on the model: what a spare has done before a load
        names one (W1), and what a fresh worker does first (W3's `hello` phase)."""
        import mlx.core as mx

        from shared.probe import gpu_kind
        from worker.allocator import AllocatorLimits
        from worker.own_memory import MemorySampler, set_discrete_device
        from worker.readings import Readings
        from worker.warm_start import prepare_engine

        device = prepare_engine()
        try:
            info: dict[str, int | float | str] = {
                k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
        except Exception:  # older MLX
            info = {}
        self.device = device
        self.discrete = gpu_kind(info) == "cuda" and "gpu" in device
        set_discrete_device(self.discrete)
        self.sampler = MemorySampler()
        self.readings = Readings(self.spec, self.ledger, self.sampler, self.wire.report)
        self.allocator = AllocatorLimits(mx, device_info=info)
        self.allocator.apply(self.limits)
        self.readings.enter("spare" if self.spec.spare else "loading")
        self.readings.write(time.monotonic(), None, self.allocator)  # the guard's tick the hello wakes reads it
        self.wire.reply(p.Hello(worker_id=self.spec.worker_id, model_id=self.spec.model_id, pid=os.getpid(),
                                device_info=info, device=device, slot=self.spec.slot, blas=blas.preload().line(),
                                spare=self.spec.spare, started=self.started))

    def wait_as_spare(self) -> p.WorkerSpec | None:
        """W1: answer pings, show memory, obey a drain, until a `TakeModel` names the model."""
        from worker.spare import SpareWait

        assert self.allocator is not None  # prepare() set it up
        wait = SpareWait(self.spec, self.wire.reply, self.sampler.reclaim)
        log.info("spare: MLX and the engine imported; waiting for a model")
        while not wait.over:
            if self.wire.wait(int(self.spec.sample_interval * 1000)):
                for msg in self.wire.commands():
                    wait.obey(msg)
                    if wait.over:
                        break
            if os.getppid() != self.spec.supervisor_pid:
                log.error("the supervisor (pid %d) is gone; exiting", self.spec.supervisor_pid)
                return None
            self.limits = wait.limits
            self.allocator.apply(self.limits)
            now = time.monotonic()
            self.clock.leave_step(0)  # a turn of the wait is a step boundary: the loop is not stuck
            self.readings.write(now, None, self.allocator)
            self.readings.maybe_send(now, self.limits, None)
        return wait.taken

    def load(self) -> int:
        """Load the model named by the spec (phases timed, W3), say so, run the loop."""
        from worker.cache_tiers import CacheTiers
        from worker.engine import Engine, EngineError
        from worker.loader import LoadMeter
        from worker.own_memory import device_bytes
        from worker.prefill import DeviceUsage

        assert self.allocator is not None  # prepare() set it up
        began = time.monotonic()
        self.readings.enter("loading")
        self.readings.write(began, self.engine, self.allocator)
        time.sleep(delay_for_tests(LOAD_DELAY_ENV))
        # Defence in depth: mlx_lm reads config.json whole, and a 1 GiB sparse
        # one took this worker to 2 GiB before it was killed as wedged; the supervisor
        # refuses such a model before a spawn, and so does the worker, before mlx_lm.
        try:
            refused = config_refusal(self.spec.model_path)
        except OSError:
            refused = None  # a passing failure: the loader below says it in its own words
        if refused is not None:
            log.error("cannot load %s: %s", self.spec.model_path, refused)
            self.wire.reply(p.LoadFailed(error=refused))
            return 2
        meter = LoadMeter(self.clock)
        try:
            # on a discrete device a prefill's peak is device memory: G1-G3 hold it to the device pool
            usage = DeviceUsage(self.readings.group_device_bytes, device_bytes) if self.discrete else None
            self.engine = load_model(self.spec, usage, meter)
            if "gpu" in self.device and isinstance(self.engine, Engine):  # a GPU's first-use costs: paid here
                with meter.phase("warm_up"):
                    log.info("warm-up: a request alone and a group in %.2f s", self.engine.warm_up())
        except (EngineError, OSError, ValueError) as exc:
            meter.done()
            log.error("cannot load %s: %s", self.spec.model_path, exc)
            self.wire.reply(p.LoadFailed(error=str(exc)))
            return 2
        with meter.phase("build"):  # the prompt cache's tiers (H5: its folder indexed) are built too
            self.tiers = CacheTiers(self.spec, self.ledger, self.engine, self.sampler, self.wire.report)
            self.tiers.open_disk()
        meter.done()
        self.readings.enter("ready")
        now = time.monotonic()
        self.wire.reply(p.Loaded(weight_bytes=self.engine.weight_bytes, seconds=now - began,
                                 usage=self.readings.write(now, self.engine, self.allocator), began=began,
                                 phases=meter.phases))
        return self.loop()

    def loop(self) -> int:
        assert self.engine is not None and self.allocator is not None  # serve() set both up
        while True:
            idle = not self.engine.has_work
            self.take_commands(block_ms=self.idle_wait_ms())
            if idle and self.engine.has_work:
                self.gather_burst()
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
            events = p.coalesce([*self.engine.step(limits, self.readings.group_usage)])
            self.clock.leave_step(self.engine.tokens_total)
            for ev in events:
                self.wire.reply(ev)  # engine events are the wire's own Structs
            self.step_boundary()
            if self.tiers.quantize_at_soft(limits):
                self.readings.soon("shrink")
            now = time.monotonic()
            self.readings.write(now, self.engine, self.allocator)
            self.readings.maybe_send(now, limits, self.engine)
            self.tiers.report()
            # Not has_work alone: a request waiting for the supervisor's memory answer
            # leaves the engine idle, yet it runs and must end before we do.
            if self.draining and not self.engine.has_work and not self.engine.running:
                self.tiers.save()
                log.info("drained; exiting")
                return 0

    def gather_burst(self) -> None:
        """Requests sent together reach an idle worker a few ms apart: take the ones right behind
        the first (each within BURST_QUIET_MS of the last, BURST_SECONDS at most) before a step.

        Why: commands are read between steps only. The first of 4 requests sent at once started
        its prefill alone, and the other 3, in the socket 1 ms later, waited for that whole first
        step (1.4-2.7 s on SmolLM2 Q4_1 on a CPU) and were then grouped apart from it: two
        prefills and, while the three prefilled, the first decoding alone, one forward pass per
        token (~33 ms of fixed cost each there) and guessing ahead (worker/speculate.py) whose
        checks cost whole passes. Taken together they form one group (worker/group_prefill.py)
        and one decode batch, as mlx_lm.server batches them. A lone request pays the quiet wait."""
        assert self.engine is not None  # called from loop(), once the model is loaded
        if getattr(self.engine, "max_concurrency", 1) <= 1:
            return  # nothing could join it
        deadline = time.monotonic() + BURST_SECONDS
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.wire.wait(min(BURST_QUIET_MS, left_ms)):
                return
            self.take_commands(block_ms=0)

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

    def step_boundary(self) -> None:
        if self.allocator is not None:
            self.allocator.hold_pool()  # M1 where MLX's allocator does not bound its own pool (CUDA)
        if self.drill is not None:
            # obey what arrived during the step (an abort ends the drill)
            # before the drill grows again, as a runaway request would stop
            self.take_commands(block_ms=0)
        if self.drill is not None:
            self.drill.advance(time.monotonic())
        if (self.shrink_pending or self.reclaim_pending) and self.engine is not None:
            self.engine.drop_draft()  # under pressure the draft model goes first (worker/draft.py)
        for shrink in self.shrink_pending:
            self.wire.reply(p.Reclaimed(cmd=shrink.cmd, freed_bytes=self.tiers.shrink(shrink)))
            self.readings.soon("shrink")
        self.shrink_pending.clear()
        if self.reclaim_pending:
            assert self.engine is not None  # called from loop(), once the model is loaded
            pending = [r for r in self.reclaim_pending if not (r.idle_only and self.engine.has_work)]
            if pending:
                freed = self.sampler.reclaim()
                for r in pending:
                    self.reclaim_pending.remove(r)
                    self.wire.reply(p.Reclaimed(cmd=r.cmd, freed_bytes=freed))

    def close(self) -> None:
        if self.heartbeat.is_alive():
            self.heartbeat.stop()
        if self.drill is not None:
            self.drill.release()
        self.wire.close()
        self.ctx.term()
        self.ledger.close()

    # -- commands -------------------------------------------------------------

    def take_commands(self, block_ms: int) -> None:
        if block_ms and not self.wire.wait(block_ms):
            return
        for msg in self.wire.commands():
            self.clock.enter_step()  # tokenizing a long prompt is work too, not silence
            self.obey(msg)
            self.clock.leave_step(self.engine.tokens_total if self.engine else 0)

    def obey(self, msg: p.CommandMsg) -> None:
        engine = self.engine
        assert engine is not None  # commands are taken once the model is loaded
        match msg:
            case p.Ping():
                self.wire.reply(p.Pong(seq=msg.seq))
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
                self.tiers.grant(msg.save_seconds)
                self.readings.enter("draining")
                engine.abort_queued("the model is being unloaded: " + (msg.reason or "drain"), code="model_unloading")
            case p.Drill():
                self.start_drill(msg)
            case p.DrillStop():
                self.stop_drill("stopped by command")
            case p.Tokenize() | p.Detokenize():  # answered now, between two steps
                self.answer_tokens(msg)
            case p.TakeModel():  # W1: for spares only; this one serves a model already
                self.wire.reply(p.Ack(cmd=msg.cmd, ok=False, detail="this worker is not a spare"))
            case _:
                assert_never(msg)
        if isinstance(msg, (p.Drain, p.AbortRequests)):
            self.wire.reply(p.Ack(cmd=msg.cmd))

    def answer_tokens(self, msg: p.Tokenize | p.Detokenize) -> None:
        """The model's tokenizer on request (worker/tokens.py; it never raises)."""
        from worker import tokens  # imports MLX (worker.request), which serve() has loaded by now
        from worker.engine import Engine

        if not isinstance(self.engine, Engine):  # an Embedder: its tokenizer is not a generator's
            self.wire.reply(p.Failed(request_id=msg.request_id, code=WRONG_MODEL_KIND,
                                     message="this model is an embedding model: /tokenize and /detokenize serve "
                                             "models that generate text"))
            return
        tokenizer = self.engine.tokenizer
        self.wire.reply(tokens.tokenize(tokenizer, msg) if isinstance(msg, p.Tokenize)
                        else tokens.detokenize(tokenizer, msg))

    def submit(self, msg: p.Generate) -> None:
        if self.draining:
            self.wire.reply(p.Failed(request_id=msg.request_id, code="model_unloading",
                                     message="the model is being unloaded; retry to load it again"))
            return
        assert self.engine is not None  # commands are taken once the model is loaded
        self.engine.submit_generate(msg)  # a bad prompt fails through the next step()

    def submit_embed(self, msg: p.Embed) -> None:
        """An Embed for an embedding model; a chat model answers that it has none."""
        from worker.embedder import Embedder

        if self.draining:
            self.wire.reply(p.Failed(request_id=msg.request_id, code="model_unloading",
                                     message="the model is being unloaded; retry to load it again"))
        elif isinstance(self.engine, Embedder):
            self.engine.submit_embed(msg)
        else:
            self.wire.reply(p.Failed(request_id=msg.request_id, code=WRONG_MODEL_KIND,
                                     message="this model generates text; it is not an embedding model"))

    def start_drill(self, msg: p.Drill) -> None:
        if not self.spec.allow_drills:
            self.wire.reply(p.Ack(cmd=msg.cmd, ok=False, detail="drills are off (serve --allow-drills)"))
            return
        from worker.drill import DrillAllocation

        self.stop_drill("replaced by a new drill")
        self.drill = DrillAllocation(rate=msg.rate, target=msg.to, now=time.monotonic())
        self.wire.event("drill", self.drill.start_words())
        self.wire.reply(p.Ack(cmd=msg.cmd))

    def stop_drill(self, why: str) -> None:
        if self.drill is not None:
            words = self.drill.release_words(why)
            self.drill = None
            self.sampler.reclaim()
            self.wire.event("drill", words)


def load_model(spec: p.WorkerSpec, device: DeviceUsage | None, meter: LoadMeter | None = None) -> Engine | Embedder:
    """A sentence-embedding folder gets the Embedder, any other the chat engine (which holds
    its prefills to the device pool on a discrete device); `meter` times the phases (W3)."""
    from worker.embedder import Embedder
    from worker.engine import Engine

    kwargs = dict(max_concurrency=spec.max_concurrency, chunk_seconds=spec.chunk_seconds)
    if read_embedding_spec(spec.model_path) is not None:
        if meter is None:
            return Embedder.load(spec.model_path, **kwargs)
        with meter.phase("read"):  # its encoder is small: one phase
            return Embedder.load(spec.model_path, **kwargs)
    if is_vision_model(spec.model_path):  # images in: the chat engine with a vision tower (worker/vision.py)
        from worker.engine import EngineError
        from worker.vision import VisionEngine

        if spec.draft_path:  # mlx-vlm's towers feed the prefill; a draft model would guess without them
            raise EngineError("load_failed", f"{spec.model_path} is a vision model: a draft model cannot guess for it")
        return VisionEngine.load(spec.model_path, device=device, meter=meter, prefill_order=spec.prefill_order,
                                 **kwargs)
    return Engine.load(spec.model_path, device=device, meter=meter, prefill_order=spec.prefill_order,
                       draft_path=spec.draft_path, **kwargs)
