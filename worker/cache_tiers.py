"""The prompt cache's tiers beyond memory, as one worker runs them: shrink on
command (H3), quantize before drop (H6 as proposed), the disk tier (H5 as
proposed), and their figures to the supervisor.

Why apart from the loop: these are the cache's answers to memory pressure and
to a stop, each a few lines over the engine's own cache, and they share one
report (`CacheReport`) that must go out when any of them changed something and
once more, final, before the process exits. An Embedder keeps no prompt cache:
everything here but the shrink and the first report is then a no-op.

MLX is not imported here at module level: the engine comes in loaded.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared import protocol as p
from shared.ledger import Ledger
from shared.limits import Limits

if TYPE_CHECKING:  # types only: these import MLX
    from worker.disk_cache import DiskTier
    from worker.embedder import Embedder
    from worker.engine import Engine
    from worker.own_memory import MemorySampler

log = logging.getLogger("memvisor.worker")

MAX_SAVE_SECONDS = 3600.0  # a Drain asking for more is a bad frame's number, not a grace


class CacheTiers:
    def __init__(self, spec: p.WorkerSpec, ledger: Ledger, engine: Engine | Embedder, sampler: MemorySampler,
                 report: Callable[[p.Msg], None]) -> None:
        from worker.engine import Engine  # loaded with MLX by now

        self.spec = spec
        self.ledger = ledger
        self.engine = engine
        self.chat = engine if isinstance(engine, Engine) else None  # an Embedder keeps no prompt cache
        self.sampler = sampler
        self._report = report
        self.disk: DiskTier | None = None
        self.save_seconds = 0.0   # what the Drain gave for writing the cache to disk
        self.quantized = (0, 0)   # entries quantized in memory, bytes that returned
        self._reported_from: tuple[p.DiskCacheStats | None, tuple[int, int]] | None = None

    def open_disk(self) -> None:
        """H5: index this model's folder (headers only) so requests can read their prefix back."""
        from worker.disk_cache import DiskTier
        from worker.kv_layout import probe

        chat = self.chat
        if chat is not None and self.spec.disk_cache_max and chat.endings.cacheable:
            model = chat.model  # the entries read back are checked against its KV (H5.3), learned at the first read
            self.disk = DiskTier.open(self.spec.model_id, Path(self.spec.model_path), self.spec.disk_cache_max,
                                      layout=lambda: probe(model))
            chat.use_disk_tier(self.disk, spill_seconds=min(self.spec.disk_cache_grace, MAX_SAVE_SECONDS))
        self.report()

    def shrink(self, msg: p.ShrinkCache) -> int:
        """H3: drop LRU entries no request uses and return the pool; the bytes the pool gave back.
        H6 (as proposed): with quantization on, unused entries are quantized first and
        only what that leaves over the target is dropped."""
        if self.chat is not None and self.spec.cache_quantize_bits:
            self._count_quantized(*self.chat.quantize_cache(self.spec.cache_quantize_bits, msg.target_bytes))
        dropped = self.engine.shrink_cache(msg.target_bytes)
        freed = self.sampler.reclaim()
        log.info("prompt cache shrunk by %d bytes toward %d (%s); pool returned %d bytes",
                 dropped, msg.target_bytes, msg.reason or "asked by the supervisor", freed)
        return freed

    def quantize_at_soft(self, limits: Limits) -> bool:
        """H6: at soft pressure, shrink unused entries before the guard has to drop them.
        True when some were (memory went back: worth a sample at once)."""
        bits = self.spec.cache_quantize_bits
        if not bits or limits.soft_limit <= 0:
            return False
        engine = self.chat
        if engine is None or not engine.prompt_cache.quantizable():
            return False
        if self.ledger.group_usage() < limits.soft_limit:
            return False
        count, returned = engine.quantize_cache(bits)
        if not count:
            return False
        freed = self.sampler.reclaim()
        log.info("soft pressure: %d prompt-cache entries quantized to %d bits, %d bytes returned "
                 "(pool gave back %d)", count, bits, returned, freed)
        self._count_quantized(count, returned)
        return True

    def grant(self, seconds: float) -> None:
        """What a Drain gives for writing the cache to disk, bounded: a frame's number, not a promise."""
        self.save_seconds = min(seconds, MAX_SAVE_SECONDS) if math.isfinite(seconds) and seconds > 0 else 0.0

    def save(self) -> None:
        """H5: drained, write the cache's entries within the grace the Drain gave; report, then exit."""
        chat = self.chat
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
        self.report(final=True)

    def _count_quantized(self, count: int, returned: int) -> None:
        self.quantized = (self.quantized[0] + count, self.quantized[1] + returned)

    def report(self, final: bool = False) -> None:
        """The tiers' figures to the supervisor, when they changed (and always the last one).
        Called every step: it compares two references before it builds anything."""
        base = self.disk.stats if self.disk is not None else None
        if (base, self.quantized) == self._reported_from and not final:
            return
        self._reported_from = (base, self.quantized)
        stats = msgspec.structs.replace(base or p.DiskCacheStats(), quantized_entries=self.quantized[0],
                                        quantized_bytes=self.quantized[1])
        self._report(p.CacheReport(worker_id=self.spec.worker_id, model_id=self.spec.model_id, pid=os.getpid(),
                                   stats=stats, final=final))
