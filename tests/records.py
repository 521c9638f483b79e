"""Build policy inputs in tests with the memory figures spelled flat.

`WorkerRecord` carries the worker's `MemoryReading` whole (one struct from the
worker to the policy); table tests read better with `usage=..., mlx_pool=...`
side by side with the other fields, so this splits them.
"""

from __future__ import annotations

from typing import Any

from shared.memory import MemoryReading
from supervisor.policy.snapshot import WorkerRecord

MEMORY_FIELDS = frozenset(MemoryReading.__struct_fields__)


def record(**kw: Any) -> WorkerRecord:
    memory = {k: kw.pop(k) for k in list(kw) if k in MEMORY_FIELDS}
    return WorkerRecord(memory=MemoryReading(**memory), **kw)
