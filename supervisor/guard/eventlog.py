"""SPEC S2: every event the supervisor emits, with its reason, in one place.

An event is kept in a bounded history (for `status`), published on the bus
(PUB `event`, and through it GET /v1/events) and handed to the hooks that
count them (the metrics). Each part of the supervisor gets `emit` and says
what happened in words; none of them knows who listens.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Callable, Protocol

from shared import protocol as p
from shared.vocab import GuardEventKind
from supervisor.wiring.fanout import EVENT_HISTORY

if TYPE_CHECKING:
    from supervisor.wiring.bus import Bus


class Emit(Protocol):
    """What the pool, the enforcer, the models and the reload call to say what happened."""

    def __call__(self, kind: GuardEventKind, reason: str, *, worker_id: str = "", model_id: str = "", usage: int = 0,
                 ceiling: int = 0, load: p.LoadReport | None = None) -> None: ...


class EventLog:
    def __init__(self, history: int = EVENT_HISTORY) -> None:
        self.events: collections.deque[p.GuardEvent] = collections.deque(maxlen=history)
        self.hooks: list[Callable[[p.GuardEvent], None]] = []
        self.bus: Bus | None = None  # attached once the sockets are bound

    def emit(self, kind: GuardEventKind, reason: str, *, worker_id: str = "", model_id: str = "", usage: int = 0,
             ceiling: int = 0, load: p.LoadReport | None = None) -> None:
        ev = p.GuardEvent(t=time.time(), kind=kind, reason=reason, worker_id=worker_id, model_id=model_id,
                          usage=usage, ceiling=ceiling, load=load)
        self.events.append(ev)
        if self.bus is not None:
            self.bus.publish(ev)
        for hook in self.hooks:
            hook(ev)

    def recent(self, count: int) -> list[p.GuardEvent]:
        return list(self.events)[-count:]
