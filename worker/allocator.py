"""MLX's own allocator, told the limits the worker obeys (SPEC M1, M2).

Why: the prefill guard checks limits before each chunk, but between two
checks MLX allocates freely and keeps what it frees in its pool. Telling MLX
itself closes that gap: with `set_memory_limit` at the hard limit MLX frees
its pool before it grows past it, and `set_cache_limit` bounds the pool to
`[guard] pool_max` (P4's threshold) so a fat pool does not wait for the
supervisor to ask. Where the allocator does not bound its pool by that
limit (MLX's CUDA backend: `../shared/device-cuda.md` found that
`set_memory_limit` does not cap there, and the pool is its cache), the worker
returns the pool itself at a step boundary when it is over the cap
(`hold_pool`), counted in its memory sample.

On macOS the worker wires nothing by default (M2, revised 2026-12-05): a
residency set (`set_wired_limit`) under concurrent requests and cache churn
is the reproduced trigger of the IOGPU `completeMemory() prepare count
underflow` kernel panic (ml-explore/mlx#3186). Only with `[guard]
wire_weights = true` does the supervisor hand a residency ceiling
(`Limits.residency` > 0); the worker then wires min(that, C13), within the
kernel's cap, and unwires when it goes back to 0. The supervisor says when
the kernel's cap is below the suggestion (once, with the `sysctl` line).

MLX is passed in (`mx`), so the rules are tested with a fake that records
calls; the macOS part (M2) is written and tested that way only, on Linux it
is never called. The C13 arithmetic is repeated here from the supervisor's
ceilings (a worker never imports `supervisor`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from shared.limits import NO_CACHE_LIMIT_ENV, Limits
from shared.sizes import MiB

log = logging.getLogger("memvisor.worker.allocator")




def wired_suggestion(desired: int, total: int) -> int:
    """C13: never within 5% of RAM, floored to whole MiB (what `iogpu.wired_limit_mb` takes)."""
    suggestion = max(0, desired)
    if total > 0:
        suggestion = min(suggestion, total - total // 20)
    return suggestion // MiB * MiB


class AllocatorLimits:
    """Applies M1 whenever the limits change, and M2 once the residency ceiling is known."""

    def __init__(self, mx: Any, *, device_info: dict | None = None, platform: str = sys.platform):
        self.mx = mx
        self.info = device_info or {}
        self.macos = platform == "darwin"
        self._applied: tuple[int, int] | None = None
        self._default_memory: int | None = None
        self._default_cache: int | None = None
        self._wired_for = 0
        self.wired = 0
        self.pool_cap = 0       # the pool MLX was told it may keep (M1); 0 = never told
        self.pool_returns = 0   # step boundaries at which the pool was over it and returned here
        self.pool_returned = 0  # the bytes those returns gave back

    def apply(self, limits: Limits) -> None:
        """M1 (and M2 on macOS); a no-op when nothing changed since the last call."""
        key = (max(0, limits.hard_limit), max(0, limits.pool_max))
        if key != self._applied:
            self._applied = key
            self._set_memory(key[0])
            self._set_cache(key[1])
        if self.macos and max(0, limits.residency) != self._wired_for:
            self._wired_for = max(0, limits.residency)
            self._wire(self._wired_for)

    def _set_memory(self, hard: int) -> None:
        """0 (guard off) puts MLX's own default back."""
        if hard > 0:
            previous = self.mx.set_memory_limit(hard)
            if self._default_memory is None:
                self._default_memory = previous
        elif self._default_memory is not None:
            self.mx.set_memory_limit(self._default_memory)

    def _set_cache(self, pool: int) -> None:
        """The pool MLX may keep: pool_max, never above MLX's own default (Linux CPU: 32 MiB)."""
        if os.environ.get(NO_CACHE_LIMIT_ENV) == "1":
            return
        if pool > 0:
            if self._default_cache is None:
                self._default_cache = self.mx.set_cache_limit(pool)
            self.pool_cap = min(pool, self._default_cache)
            self.mx.set_cache_limit(self.pool_cap)
        elif self._default_cache is not None:
            self.mx.set_cache_limit(self._default_cache)
            self.pool_cap = self._default_cache

    def hold_pool(self) -> int:
        """M1 at a step boundary: a pool over the cap MLX was given goes back now; the bytes freed.

        Where MLX bounds its pool itself (Metal, CPU) the pool never exceeds the
        cap and this is one counter read. Where it does not (CUDA), a fat pool
        would otherwise wait for the supervisor's P4 reclaim, a tick later and
        only above 2 GiB of pool per worker.
        """
        if self.pool_cap <= 0:
            return 0
        pool = self.mx.get_cache_memory()
        if pool <= self.pool_cap:
            return 0
        self.mx.clear_cache()
        freed = max(0, pool - self.mx.get_cache_memory())
        if not self.pool_returns:
            log.info("MLX's pool (%d bytes) was over its cap of %d bytes: the worker returns it at step "
                     "boundaries (the allocator does not bound it)", pool, self.pool_cap)
        self.pool_returns += 1
        self.pool_returned += freed
        return freed

    def _wire(self, residency: int) -> None:
        """M2: wire min(residency ceiling, C13 suggestion), within the kernel's cap; 0 unwires."""
        total = int(self.info.get("memory_size", 0) or 0)
        kernel_cap = int(self.info.get("max_recommended_working_set_size", 0) or 0)
        target = min(residency, wired_suggestion(residency, total))
        if 0 < kernel_cap < target:
            target = kernel_cap  # the supervisor tells people how to raise it (C13)
        if target <= 0 and self.wired <= 0:
            return  # never wired: nothing to undo
        try:
            self.mx.set_wired_limit(max(0, target))
            self.wired = max(0, target)
        except (ValueError, RuntimeError) as exc:  # the kernel refused: keep serving unwired
            log.warning("cannot wire %d bytes: %s", target, exc)
