"""The worker's memory reading: measured once a step (U1, H2), written to its
ledger slot, and pushed to the supervisor as a `Sample` when due.

Why both: the ledger slot is what the supervisor reads whenever it decides,
with no message in between; the pushed sample is what wakes it. It goes at a
steady rate, and at once when the group crosses a watermark (either way) or the
worker has just given memory back, so the guard never waits a whole interval to
see what changed. Both carry the very same reading.

MLX is not imported here: the sampler and the engine come in loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared import protocol as p
from shared.ledger import Ledger
from shared.limits import Limits
from shared.memory import NO_READING
from shared.vocab import SampleReason, WorkerPhase

if TYPE_CHECKING:  # types only: these import MLX
    from worker.allocator import AllocatorLimits
    from worker.embedder import Embedder
    from worker.engine import Engine
    from worker.own_memory import Held, MemorySampler


class Readings:
    def __init__(self, spec: p.WorkerSpec, ledger: Ledger, sampler: MemorySampler,
                 report: Callable[[p.Msg], None]) -> None:
        self.spec = spec
        self.ledger = ledger
        self.sampler = sampler
        self._report = report
        self.phase: WorkerPhase = "starting"
        self.urgent: SampleReason | None = None  # a reason to publish the next sample at once
        self.seq = 0
        self.last_sent = 0.0
        self._last = NO_READING  # the latest reading, sent as is in the next Sample
        self.last_level = 0

    def enter(self, phase: WorkerPhase) -> None:
        """The worker's phase as the ledger shows it; "ready" and "busy" then follow the work."""
        self.phase = phase

    def soon(self, why: SampleReason) -> None:
        """Publish the next sample at once (memory was just given back), not at the next tick."""
        self.urgent = why

    def write(self, now: float, engine: Engine | Embedder | None, allocator: AllocatorLimits | None) -> int:
        """Measure once (U1, H2) and put the reading where the supervisor reads it."""
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

    def maybe_send(self, now: float, limits: Limits, engine: Engine | Embedder | None) -> None:
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
        why: SampleReason = "watermark" if crossed else self.urgent or "tick"
        self.urgent = None
        if why == "tick" and now - self.last_sent < self.spec.sample_interval:
            return
        self.last_sent = now
        self.seq += 1
        self._report(p.Sample(
            worker_id=self.spec.worker_id, model_id=self.spec.model_id, pid=os.getpid(), seq=self.seq, t=now,
            memory=self._last, running=engine.running if engine else 0, queued=engine.queued if engine else 0,
            tokens=engine.tokens_total if engine else 0, why=why,
        ))

    def group_usage(self) -> int:
        """SPEC U2 seen from here: fresh own usage + the others' latest samples."""
        s = self.sampler.sample()
        mine = self.ledger.read_sample(self.spec.slot)
        others = self.ledger.group_usage() - (mine.memory.usage if mine else 0)
        return others + s.usage

    def group_device_bytes(self) -> int:
        """D1's fallback for the group seen from here: fresh own MLX active + pool + the others'."""
        from worker.own_memory import device_bytes

        mine = self.ledger.read_sample(self.spec.slot)
        others = self.ledger.group_device_bytes() - (mine.memory.mlx_active + mine.memory.mlx_pool if mine else 0)
        return others + device_bytes()


def _held(engine: Engine | Embedder) -> Held:
    """What the model's engine holds for the sample: the chat engine names its decode batch too."""
    from worker.engine import Engine  # imported with MLX in serve(); a cached lookup here
    from worker.own_memory import Held

    return engine.held() if isinstance(engine, Engine) else Held(engine.cache_bytes, engine.cache_releasable)
