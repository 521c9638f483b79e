"""The pressure tables' guard and shorthand (no tests here): SPEC P's tick on workers spelt in GiB.

The guard uses the custom tier with a 10 GiB ceiling on a 64 GiB machine and
explicit thresholds, so soft is 8 GiB and hard 9 GiB: every figure in the
tables is plain arithmetic. `tests/test_p_policy.py` and `tests/test_p_eviction.py`
share it.
"""

from __future__ import annotations

import msgspec

from shared.host import HostCounters
from shared.sizes import GiB
from supervisor.policy import decisions as d
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, PolicyState, Snapshot, WorkerRecord
from tests.records import record

CEIL = 10 * GiB
GUARD = GuardSettings(tier="custom", custom_ceiling=CEIL, soft_threshold=0.8, hard_threshold=0.9)
HOST = HostCounters(total=64 * GiB)
NOW = 1000.0


def w(name: str, gib: float = 1.0, **kw) -> WorkerRecord:
    """A worker using `gib` GiB (usage = footprint), ready and idle unless told."""
    size = int(gib * GiB)
    kw.setdefault("model", f"m-{name}")
    kw.setdefault("footprint", size)
    return record(worker=name, usage=size, **kw)


def busy(name: str, gib: float = 1.0, **kw) -> WorkerRecord:
    return w(name, gib, state="busy", running=1, **kw)


def snap(*workers: WorkerRecord, state: PolicyState | None = None, guard: GuardSettings = GUARD,
         **kw) -> Snapshot:
    kw.setdefault("now", NOW)
    kw.setdefault("host", HOST)
    return Snapshot(guard=guard, workers=list(workers), state=state or PolicyState(), **kw)


def acts(result) -> list[tuple[str, str]]:
    """The actions on workers, in order (limits and concurrency left out)."""
    return [(x.__struct_config__.tag, x.worker) for x in result.decisions
            if hasattr(x, "worker") and not isinstance(x, (d.ApplyLimits, d.SetConcurrency))]


def of(result, kind) -> list:
    """The decisions of one kind, the tick's HandOutLimits spelt out as one decision a worker."""
    return [x for x in d.per_worker(result.decisions) if isinstance(x, kind)]


def run(*snaps: Snapshot):
    """Tick a sequence, feeding each state into the next like the enforcer."""
    state, result = None, None
    for s in snaps:
        if state is not None:
            s = msgspec.structs.replace(s, state=state)
        result = tick(s)
        state = result.state
    return result
