"""Driving an engine in a test: a tiny model's engine, a prompt's tokens, its events per request,
steps until it has no work, and the limits the engine tests share (no tests here)."""

from __future__ import annotations

from collections import defaultdict

from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from shared.sizes import GiB
from worker.engine import Engine

OPEN = Limits(max_concurrency=8)  # guard off, room for everyone


def engine_for(loaded, **kwargs) -> Engine:
    model, tokenizer = loaded
    kwargs.setdefault("own_usage_fn", lambda: 0)
    return Engine(model, tokenizer, **kwargs)


def prompt_tokens(engine: Engine, text: str = "Once upon a time") -> list[int]:
    return engine.encode_prompt(text)


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


GUARDED = Limits(soft_limit=9 * GiB, hard_limit=10 * GiB, hard_watermark=int(9.5 * GiB),
                 abort_limit=12 * GiB, abort_margin=0.93, prefill_headroom_safety=0.92,
                 static=12 * GiB, dynamic=10 * GiB, ceiling=10 * GiB, binding="dynamic",
                 min_chunk_tokens=4, max_concurrency=4)
