"""Prompt-cache KV entries and a guard with cached bytes, for the prompt-cache tests (no tests here)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from shared.host import HostCounters
from shared.memory import MemoryReading
from shared.sizes import GiB
from supervisor.policy.snapshot import GuardSettings, WorkerRecord


def kv(tokens: int, layers: int = 2, fill: float = 1.0) -> list[KVCache]:
    """Real MLX KV of `tokens` tokens, as a model's layers would hold it."""
    out = []
    for _ in range(layers):
        c = KVCache()
        x = mx.full((1, 2, tokens, 4), fill, dtype=mx.float32)
        c.update_and_fetch(x, x)
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


GUARD = GuardSettings(tier="custom", custom_ceiling=10 * GiB, soft_threshold=0.8, hard_threshold=0.9,
                      hot_cache_max=3 * GiB, pool_max=2 * GiB)


HOST = HostCounters(total=64 * GiB)


def worker(name: str, cached: int = 0) -> WorkerRecord:
    return WorkerRecord(worker=name, model=f"m-{name}", pid=100 + len(name), memory=MemoryReading(usage=GiB, footprint=GiB, cache_bytes=cached,
                                                                        cache_releasable=cached))
