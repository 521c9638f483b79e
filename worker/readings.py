"""The worker's memory reading: measured once a step (U1, H2), written to its
ledger slot, and pushed to the supervisor as a `Sample` when due.

Why both: the ledger slot is what the supervisor reads whenever it decides,
with no message in between; the pushed sample is what wakes it. It goes at a
steady rate, and at once when the group crosses a watermark (either way) or the
worker has just given memory back, so the guard never waits a whole interval to
see what changed. Both carry the very same reading.

How often: after a step, a full reading (the footprint from /proc, the
ledger slot, the group's level: 25-35 us timed alone, and several times that
beside MLX's evaluation thread on a loaded CPU) is taken when one may have
moved since the last: `READ_GAP` has passed, MLX's own bytes (active + pool:
counters that cost 0.1 us) moved by `MOVED_BYTES`, the group sat within
`NEAR_SHARE` of a watermark, the limits changed, a request started or ended,
a command was obeyed, or memory was just given back. A runaway allocation
is MLX's and is read at the step it happens; what grows outside MLX is seen
within READ_GAP. A step on a GPU takes longer than READ_GAP, so there every
step is still read; at one stream on a CPU (a step every 1.5-2 ms) about
two in three are skipped.

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
from shared.sizes import MiB
from shared.vocab import SampleReason

if TYPE_CHECKING:  # types only: these import MLX
    from worker.allocator import AllocatorLimits
    from worker.embedder import Embedder
    from worker.engine import Engine
    from worker.memory import Held, MemorySampler


READ_GAP = 0.005  # seconds between two full readings while nothing moves (module docstring)
MOVED_BYTES = 1 * MiB  # MLX's active + pool bytes moved this much: read at once
NEAR_SHARE = 0.02  # the group within this share of the worker's ceiling from a watermark: read every step


class Readings:
    def __init__(self, spec: p.WorkerSpec, ledger: Ledger, sampler: MemorySampler,
                 report: Callable[[p.Msg], None], mlx_bytes: Callable[[], int]) -> None:
        self.spec = spec
        self.ledger = ledger
        self.sampler = sampler
        self._report = report
        self._mlx_bytes = mlx_bytes  # MLX's active + pool bytes: cheap counters, read every step
        self.phase = "starting"
        self.urgent: SampleReason | None = None  # a reason to publish the next sample at once
        self.seq = 0
        self.last_sent = 0.0
        self._last = NO_READING  # the latest reading, sent as is in the next Sample
        self.last_level = 0
        # what the last full reading saw, to tell whether the next step needs one
        self._read_at = float("-inf")
        self._read_mlx = 0
        self._read_work = (0, 0)  # (running, queued)
        self._read_limits: Limits | None = None
        self.near = False  # the group was near a watermark at the last reading

    def enter(self, phase: str) -> None:
        """The worker's phase as the ledger shows it; "ready" and "busy" then follow the work."""
        self.phase = phase

    def soon(self, why: SampleReason) -> None:
        """Publish the next sample at once (memory was just given back), not at the next tick."""
        self.urgent = why

    def refresh(self) -> None:
        """Take a full reading after the next step (a command was obeyed, memory given back)."""
        self._read_at = float("-inf")

    def after_step(self, now: float, limits: Limits, engine: Engine | Embedder,
                   allocator: AllocatorLimits) -> None:
        """The loop's reading after a step: a full one (`write`, `maybe_send`) when something
        may have moved since the last (module docstring), else none."""
        if (now - self._read_at >= READ_GAP or self.near or self.urgent is not None
                or (engine.running, engine.queued) != self._read_work or limits != self._read_limits
                or abs(self._mlx_bytes() - self._read_mlx) >= MOVED_BYTES):
            self.write(now, engine, allocator)
            self.maybe_send(now, limits, engine)

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
        self._read_at, self._read_mlx, self._read_work = now, s.mlx_active + s.mlx_pool, (running, queued)
        return s.usage

    def maybe_send(self, now: float, limits: Limits, engine: Engine | Embedder | None) -> None:
        """Steady rate, and at once when the group crosses a watermark (either way)."""
        level = 0
        self.near = False
        self._read_limits = limits
        if limits.hard_limit > 0:
            group = self.ledger.group_usage()
            marks = (limits.soft_limit, limits.hard_watermark, limits.hard_limit)
            level = sum(group >= mark for mark in marks)
            self.near = _near(group, marks, limits.hard_limit)
        if limits.device_hard > 0:  # D4: the device pool's watermarks, on the group's device bytes
            on_device = self.ledger.group_device_bytes()
            level += 4 * ((on_device >= limits.device_soft) + (on_device >= limits.device_hard))
            self.near = self.near or _near(on_device, (limits.device_soft, limits.device_hard), limits.device_hard)
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
        from worker.memory import device_bytes

        mine = self.ledger.read_sample(self.spec.slot)
        others = self.ledger.group_device_bytes() - (mine.memory.mlx_active + mine.memory.mlx_pool if mine else 0)
        return others + device_bytes()


def _near(value: int, marks: tuple[int, ...], scale: int) -> bool:
    """Whether `value` is within NEAR_SHARE of `scale` from one of `marks` (either side)."""
    return any(abs(value - mark) < NEAR_SHARE * scale for mark in marks)


def _held(engine: Engine | Embedder) -> Held:
    """What the model's engine holds for the sample: the chat engine names its decode batch too."""
    from worker.engine import Engine  # imported with MLX in serve(); a cached lookup here
    from worker.memory import Held

    return engine.held() if isinstance(engine, Engine) else Held(engine.cache_bytes, engine.cache_releasable)
