"""A load's admission verdict (SPEC A3, D5): one struct for either memory pool.

Kept apart from `admission` (host rules) and `device` (device rules) so both
build the same answer without importing each other.

Public names (stable): LoadVerdict, MODEL_TOO_LARGE, INSUFFICIENT_MEMORY.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MODEL_TOO_LARGE = "model_too_large"
INSUFFICIENT_MEMORY = "insufficient_memory"

PoolName = Literal["host", "device"]


class LoadVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """A3's answer. Refused loads map to HTTP 507 with `error`, `binding`, `remedy`,
    and a message that names the pool (`host` RAM or the discrete `device`)."""

    admitted: bool
    pool: PoolName = "host"
    evict: list[str] = []      # worker ids to stop first, least recently used first
    wait_for: list[str] = []   # draining workers whose memory the verdict counts as free
    error: str = ""            # "" | "model_too_large" | "insufficient_memory"
    binding: str = ""          # binding of the pool's admission ceiling (C6, D3)
    remedy: str = ""
    message: str = ""
    usage: int = 0             # the pool's projected usage before the load
    size: int = 0              # what the load adds to that pool
    ceiling: int = 0           # the pool's admission ceiling (C7)
    target: int = 0            # A1 evict target
