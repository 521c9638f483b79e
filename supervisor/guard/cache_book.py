"""What the supervisor knows of the prompt cache's disk tier and shrink before drop (H5, H6 as proposed).

The supervisor never reads the disk tier itself (its loop never waits on a
disk): a worker reports its model's folder when it has indexed it, after a
request read an entry back, after a quantization, and once more after its
stop's write, just before it exits (`CacheReport`). The last report of each
model stays after its worker has gone, so `ps --all` and `status` show what an
unloaded model keeps on disk. A worker's counters start at 0; the book adds
up every worker's last figures, so the totals run since the supervisor started.

A report may arrive after the pool has reaped its worker (the process exits
right after sending it), so it is taken by model, from any worker the pool
spawned for that model (`accept`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import COUNTER_NAMES, CacheReport, DiskCacheStats
from shared.sizes import format_size
from supervisor.policy.status import DiskCacheStatus

if TYPE_CHECKING:
    from supervisor.config import GuardConfig



def save_grace(guard: GuardConfig) -> float:
    """Seconds a drained worker may spend writing its prompt cache (0: the disk tier is off;
    with no memory tier it has nothing to keep)."""
    return guard.disk_cache_grace if guard.disk_cache_max and guard.hot_cache_max else 0.0


class CacheBook:
    """The last report per model and the counters of every worker so far."""

    def __init__(self) -> None:
        self.models: dict[str, DiskCacheStats] = {}
        self._worker: dict[str, str] = {}      # model id -> the worker its last report came from
        self._done: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)  # counters of workers superseded since
        self._all_bytes = 0
        self._budget = 0

    def take(self, msg: CacheReport) -> None:
        previous = self.models.get(msg.model_id)
        if previous is not None and self._worker.get(msg.model_id) != msg.worker_id:
            for name in COUNTER_NAMES:  # a new worker of the model: the old one's counts are final
                self._done[name] += getattr(previous, name)
        self.models[msg.model_id] = msg.stats
        self._worker[msg.model_id] = msg.worker_id
        if msg.stats.budget:  # the tier is on: its figures for every model are the newest
            self._all_bytes, self._budget = msg.stats.all_bytes, msg.stats.budget

    def model(self, model_id: str) -> DiskCacheStats:
        return self.models.get(model_id) or DiskCacheStats()

    def status(self, setting: int, grace: float, quantize_bits: int) -> DiskCacheStatus:
        totals = {name: self._done[name] + sum(getattr(s, name) for s in self.models.values()) for name in COUNTER_NAMES}
        return DiskCacheStatus(
            max=setting, budget=self._budget, bytes=self._all_bytes,
            entries=sum(s.entries for s in self.models.values()),
            models={m: s.bytes for m, s in self.models.items() if s.entries},
            grace=grace, quantize_bits=quantize_bits, **totals)


def saved_words(s: DiskCacheStats) -> str:
    """A worker's writes to the disk tier in words (the `disk_cache` event at its exit, H5)."""
    words = (f"prompt cache to disk: {s.written_entries} entries ({format_size(s.written_bytes)}) written by "
             f"the worker; its stop's write took {s.save_seconds:.2f} s of the {s.save_deadline:g} s it had")
    if s.dropped_entries:
        words += f"; {s.dropped_entries} ({format_size(s.dropped_bytes)}) not written: the deadline came first"
    return (words + f"; {format_size(s.bytes)} on disk for this model, {format_size(s.all_bytes)} of "
            f"{format_size(s.budget)} for all")
