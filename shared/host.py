"""The machine's memory counters as the platform probes read them each tick.

Both rooms need this one fact: the probes (`shared.probe`) fill it in and the
pure policy (`supervisor.policy`) computes the ceilings from it (SPEC C2).
Sizes are bytes. A counter the OS would not give is None, and SPEC C2's
fallbacks apply: only `available` -> free = available; nothing -> dynamic =
static.
"""

from __future__ import annotations

import msgspec


class HostCounters(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    total: int                       # min(physical, container limit, budget)
    free: int | None = None
    inactive: int | None = None
    file_backed: int | None = None   # macOS external pages; Linux file pages
    active: int | None = None
    available: int | None = None     # used only when the counters above are absent
    compressor: bool = True          # the OS can compress or swap anonymous memory (T3)
