"""The working state of one policy tick: what it has decided so far and what it projects.

`supervisor.policy.pressure.tick` builds one `Tick` from the snapshot and
hands it to the rules in SPEC order (pressure.py: levels, admission, P8-P10;
worker_limits.py: what each worker is told; eviction.py: P4-P6). Each rule
appends its decisions to `out` and, when it stops a worker, takes that
worker's bytes off the projection (`stop`, `gone`): later rules in the same
tick see the memory the earlier ones will free.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.vocab import PressureLevel
from supervisor.policy.decisions import Decision, Stop
from supervisor.policy.device import device_ceilings_for
from supervisor.policy.group import WorkerGroup, ceilings_for, classify, snapshot_total
from supervisor.policy.snapshot import Snapshot, WorkerRecord


class MemoryPool:
    """One memory pool as this tick projects it: host RAM, or a discrete device (D4).

    P5 and P6 run on whichever pool is under pressure, with that pool's
    watermarks, choosing victims by the bytes they `held` there.
    """

    __slots__ = ("name", "soft", "hard", "ceiling", "projected", "held", "usage_words", "pressure_words")

    def __init__(self, name: str, soft: int, hard: int, ceiling: int, projected: int,
                 held: Callable[[WorkerRecord], int]) -> None:
        self.name, self.soft, self.hard, self.ceiling = name, soft, hard, ceiling
        self.projected, self.held = projected, held
        # the words of each stop's reason, set once: a property cost a Python call per stop
        host = name == "host"
        self.usage_words = "usage" if host else "device usage"
        self.pressure_words = "pressure" if host else "device memory pressure"

    def classify(self) -> PressureLevel:
        """P1 on the projected usage (after P5's shrink, before P6 acts)."""
        return classify(self.projected, self.ceiling, self.soft, self.hard)


def _host_bytes(w: WorkerRecord) -> int:
    return w.memory.usage  # = w.usage, without the property's Python call


def _device_bytes(w: WorkerRecord) -> int:
    return w.device_bytes


class Tick:
    """The working state of one tick; the rules are functions of it, in SPEC order."""

    def __init__(self, s: Snapshot) -> None:
        self.s = s
        self.prev = s.state
        self.out: list[Decision] = []
        self.group = WorkerGroup(s)
        self.total = snapshot_total(s)
        self.c = ceilings_for(s, self.group)
        self.stopped: set[str] = set()
        c, group = self.c, self.group
        self.host = MemoryPool("host", c.soft, c.hard, c.ceiling, group.usage - group.draining_usage, _host_bytes)
        self.dc = device_ceilings_for(s, group)
        dc = self.dc
        self.device = None if dc is None else MemoryPool(
            "device", dc.soft, dc.hard, dc.ceiling, group.device_bytes - group.draining_device_bytes, _device_bytes)
        self.credited = self.group.draining_usage
        self.rates: dict[str, float] = {}  # bytes/s of each worker that grew (growth)
        self.cache_dropped: set[str] = set()  # workers told to drop their caches for C12
        self.cache_drop_bytes = 0  # ... and the bytes that takes off the projection
        self.growers: list[WorkerRecord] = []  # runaway growers at hard (discount_draining)
        self.caps = self.group.caps  # worker -> the cap its limits carry after this tick (P8, worker_limits.py)

    @property
    def projected(self) -> int:
        return self.host.projected

    def gone(self, w: WorkerRecord) -> None:
        """A stopped process gives back what it held in every pool."""
        self.stopped.add(w.worker)
        self.host.projected -= w.memory.usage  # = w.usage, without the property's Python call
        if self.device is not None:
            self.device.projected -= w.device_bytes

    def stop(self, w: WorkerRecord, reason: str) -> None:
        self.out.append(Stop(worker=w.worker, model=w.model, reason=reason))
        self.gone(w)
