"""Driving an engine in a test: its events per request, and steps until it has no work."""

from __future__ import annotations

from collections import defaultdict

from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from worker.engine import Engine

OPEN = Limits(max_concurrency=8)  # guard off, room for everyone


class Run:
    """Events of a run, per request, in order."""

    def __init__(self):
        self.events: list = []
        self.by_id: dict[str, list] = defaultdict(list)

    def add(self, events):
        for ev in events:
            self.events.append(ev)
            self.by_id[ev.request_id].append(ev)

    def text(self, rid: str) -> str:
        return "".join(ev.text for ev in self.by_id[rid] if isinstance(ev, TokenOut))

    def tokens(self, rid: str) -> list[int]:
        return [ev.token_id for ev in self.by_id[rid] if isinstance(ev, TokenOut) and ev.token_id >= 0]

    def terminal(self, rid: str):
        ends = [ev for ev in self.by_id[rid] if isinstance(ev, (Finished, Failed))]
        assert len(ends) == 1, f"{rid}: {len(ends)} terminal events"
        assert self.by_id[rid][-1] is ends[0], f"{rid}: events after the terminal one"
        return ends[0]


def drive(engine: Engine, limits: Limits = OPEN, usage_fn=lambda: 0, max_steps: int = 2000) -> Run:
    run = Run()
    for _ in range(max_steps):
        if not engine.has_work:
            return run
        run.add(engine.step(limits, usage_fn))
    raise AssertionError("engine still busy after max_steps")
