"""T6/P8 at the enforcer: the tick's one HandOutLimits reaches each worker it names.

The pool here records what it is asked to send (the real pool writes the
ledger and a ZeroMQ command: tests/live cover that path end to end); what
is pinned is the enforcer's side of the decision: which call each entry
becomes, that a worker gone since the snapshot is skipped, and that one
failing send keeps no other worker from its limits.
"""

from __future__ import annotations

from types import SimpleNamespace

from shared.limits import Limits
from supervisor.config import Config
from supervisor.guard.enforcer import Enforcer
from supervisor.policy import decisions as d


class _Pool:
    def __init__(self, *workers: str) -> None:
        self.handles = {w: SimpleNamespace(worker_id=w) for w in workers}
        self.sent: list[tuple[str, str, int]] = []

    def set_limits(self, handle: SimpleNamespace, limits: Limits) -> None:
        if handle.worker_id == "broken":
            raise OSError("the worker's socket is gone")
        self.sent.append(("limits", handle.worker_id, limits.max_concurrency))

    def set_concurrency(self, handle: SimpleNamespace, limits: Limits) -> None:
        self.sent.append(("step", handle.worker_id, limits.max_concurrency))


def _enforcer(pool: _Pool) -> Enforcer:
    return Enforcer(config=Config(), pool=pool, bus=SimpleNamespace(publish=lambda _m: None),  # type: ignore[arg-type]
                    ledger=None, emit=lambda *a, **k: None, restarts=lambda _model: 0)


def test_t6_p8_each_entry_of_a_hand_out_reaches_its_worker_in_order():
    pool = _Pool("a", "b", "broken", "c")
    batch = d.HandOutLimits(entries=[
        ("a", "m-a", Limits(max_concurrency=3), "ok: one step", True),
        ("gone", "m-g", Limits(max_concurrency=4), "new worker", False),  # exited since the snapshot
        ("broken", "m-x", Limits(max_concurrency=4), "new worker", False),
        ("b", "m-b", Limits(max_concurrency=4), "new worker", False),
        ("c", "m-c", Limits(max_concurrency=1), "hard pressure: one step", True),
    ])
    _enforcer(pool).execute(batch, SimpleNamespace(usage=0, ceilings=SimpleNamespace(ceiling=0)))  # type: ignore[arg-type]
    assert pool.sent == [("step", "a", 3), ("limits", "b", 4), ("step", "c", 1)]
