"""What the host and the device ceilings have in common (SPEC C and D), written once.

Host RAM (ceilings.py, C1-C14) and a discrete device (device.py, D2-D6) are two
memory pools guarded with rules of the same shape. Their candidates differ,
and so do their formulas (C2's other apps and GPU cap, D3's other processes on
the GPU): those stay explicit in each module. What a ceiling then means is the
same in both, and lives here, parametrised by the pool:

- `first_binding`: C6's order, the first candidate equal to the ceiling;
- `pool_marks`: C5 (guard off: 0, "no limit"), C7 (admission: static when off),
  C9 (the admission soft target) and C11 (the soft and hard watermarks);
- `remedy`: what a person can do about the binding of either pool (C6, D3);
- `reserve_message`: C1 (and D2) when a tier reserves the whole pool;
- `previews`: C14's one line per tier, for either pool.

Public names (stable): PoolMarks, pool_marks, first_binding, remedy,
reserve_message, previews.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from shared.sizes import format_size
from shared.vocab import TIERS, Binding, PoolName, Tier

B = TypeVar("B", bound=str)
C = TypeVar("C")
P = TypeVar("P")


PoolMarks = tuple[int, int, int, int, int]
"""C5, C7, C9 and C11 of one pool, from its smallest candidate (`best`), in this order:
ceiling (C5: 0 when the guard is off, "no limit"), admission ceiling (C7: the ceiling, or
static with the guard off), admission soft target (C9), soft and hard (C11: 0 with no ceiling).
A plain tuple, not a NamedTuple: building one of those cost 3k instructions a tick."""


def pool_marks(enabled: bool, best: int, static: int, soft_threshold: float, hard_threshold: float) -> PoolMarks:
    """C5/C7/C9/C11 (D3, D4 on the device): the same arithmetic on either pool."""
    ceiling = best if enabled else 0
    admission = ceiling if enabled else static
    if ceiling <= 0:
        return ceiling, admission, int(admission * soft_threshold), 0, 0
    return (ceiling, admission, int(admission * soft_threshold), int(ceiling * soft_threshold),
            int(ceiling * hard_threshold))


def first_binding(ceiling: int, candidates: tuple[tuple[B, int], ...], none: B) -> B:
    """C6 (D3): the first candidate, in the pool's order, equal to the ceiling; `none` when off."""
    if ceiling > 0:
        for name, value in candidates:
            if value == ceiling:
                return name
    return none


_REMEDY: dict[Binding, str] = {
    "dynamic": "close other apps to give memory back to the system",
    "gpu_cap": "raise the GPU memory cap (macOS: sudo sysctl iogpu.wired_limit_mb=N)",
    "static": "choose a tier that keeps less memory in reserve (e.g. aggressive instead "
    "of balanced), or use a smaller model or a shorter context",
    "device_others": "free device memory held by other processes on the GPU (nvidia-smi lists "
    "them), or use a smaller model or a shorter context",
    "device_static": "choose a tier that keeps less device memory in reserve (e.g. aggressive "
    "instead of balanced), or use a smaller model or a shorter context",
}
# On the custom tier the user's own number is the component: C3's custom ceiling is the host's
# dynamic term, D2's custom_device_ceiling the device's static one. Raising it is the remedy.
_CUSTOM_REMEDY: dict[Binding, str] = {
    "dynamic": "raise the custom ceiling (serve --custom-ceiling SIZE, or POST /admin/guard)",
    "device_static": "set or raise [guard] custom_device_ceiling, or use a smaller model or a shorter context",
}


def remedy(binding: Binding, tier: Tier | None = None) -> str:
    """C6, D3: what a person can do about the constraint that binds, in either pool ("" if none)."""
    if tier == "custom" and binding in _CUSTOM_REMEDY:
        return _CUSTOM_REMEDY[binding]
    return _REMEDY.get(binding, "")


_RESERVED_WHAT: dict[PoolName, tuple[str, str]] = {
    "host": ("", "the machine"),
    "device": (" of device memory", "the device"),
}


def reserve_message(pool: PoolName, tier: Tier, reserve: int, total: int, exceeds: bool) -> str:
    """C1 (D2 on the device): the words for a tier that reserves the whole pool ("" otherwise)."""
    if not exceeds:
        return ""
    of, holder = _RESERVED_WHAT[pool]
    return (
        f"tier {tier!r} reserves {format_size(reserve)}{of} but {holder} has only "
        f"{format_size(total)}; every model load is refused until you choose a tier "
        "that reserves less"
    )


def previews(ceilings: Callable[[Tier], C | None], line: Callable[[C], P]) -> dict[str, P]:
    """C14 on one pool: each tier's `line` from its `ceilings`; empty when the pool is not there (None)."""
    out: dict[str, P] = {}
    for tier in TIERS:
        c = ceilings(tier)
        if c is None:
            return {}
        out[tier] = line(c)
    return out
