"""A worker's own memory, as SPEC U1 defines it.

Usage is the process footprint as the OS charges it, MLX's allocator pool
included, and never below MLX's active bytes. The pool counts because the OS
sees it as taken: a measure that left it out (the first wording of U1) could
neither see a fat pool nor see a reclaim lower the level, so P4's grace
reclaim looked like it did nothing. MLX active is the floor because the
footprint can lag an allocation (or be unreadable: 0).

macOS charges, for a moment, graphics memory MLX has already freed and the
driver has not yet taken back; U1 allows subtracting it, but MLX does not
report it, so nothing is subtracted here (on Linux there is nothing to
subtract).

The footprint comes from `shared.probe.footprint` (macOS phys_footprint,
Linux private resident memory), the same reader the supervisor uses for
itself, so the group usage of SPEC U2 adds like with like.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from shared.memory import MemoryReading
from shared.probe import footprint

# How a guard check reads the group's usage (SPEC U2) at the moment it decides.
UsageFn = Callable[[], int]


class Held(NamedTuple):
    """What the engine holds that MLX's counters do not name; every sample carries it.

    The prompt cache (H2, H3) and the decode batch's buffers against its live
    KV, with the relayouts so far, so `status` shows where the batch's memory
    goes.
    """

    cache_bytes: int = 0
    cache_releasable: int = 0
    batch_bytes: int = 0
    batch_live_bytes: int = 0
    batch_relayouts: int = 0


NOTHING_HELD = Held()
_peak_before_reset = 0
_discrete = False  # MLX runs on a discrete device (CUDA): its arrays live outside host RAM


def set_discrete_device(discrete: bool) -> None:
    """Say once, at start, whether MLX's arrays live on a discrete device.

    On CUDA, MLX active and pool bytes are device memory (SPEC D1 counts them
    there); taking them as the floor of host usage would charge the host pool
    for memory it does not hold, so U1 is then the host footprint alone.
    """
    global _discrete
    _discrete = discrete


def reset_peak() -> None:
    """Restart MLX's peak counter for a measurement, keeping the lifetime peak.

    The engine measures each prefill chunk's peak (SPEC G2's running cost);
    samples still report the process's peak since start.
    """
    global _peak_before_reset
    _peak_before_reset = max(_peak_before_reset, mx.get_peak_memory())
    mx.reset_peak_memory()


def sample(pid: int | None = None, held: Held = NOTHING_HELD, pool_returns: int = 0,
           pool_returned: int = 0) -> MemoryReading:
    """Read MLX's counters and the process footprint (U1); the caller knows what its engine
    holds (H2, the decode batch) and how often it returned the pool itself (M1)."""
    active = mx.get_active_memory()
    pool = mx.get_cache_memory()
    peak = max(_peak_before_reset, mx.get_peak_memory())
    own = footprint(os.getpid() if pid is None else pid) or 0
    return MemoryReading(
        usage=u1_usage(active, own), footprint=own, mlx_active=active, mlx_pool=pool, mlx_peak=peak,
        cache_bytes=held.cache_bytes, cache_releasable=held.cache_releasable, batch_bytes=held.batch_bytes,
        batch_live_bytes=held.batch_live_bytes, batch_relayouts=held.batch_relayouts,
        pool_returns=pool_returns, pool_returned=pool_returned,
    )


def u1_usage(mlx_active: int, footprint: int) -> int:
    """U1: the footprint, pool included, never below MLX active (host-side MLX only)."""
    return footprint if _discrete else max(mlx_active, footprint)


def device_bytes() -> int:
    """D1's fallback for this worker on a discrete device: MLX active + pool."""
    return mx.get_active_memory() + mx.get_cache_memory()


def usage() -> int:
    """U1 usage alone (the prefill guard's view of this worker's own share)."""
    return sample().usage


def reclaim() -> int:
    """Return MLX's pool to the OS; the bytes it held (P4, P6.6, G3)."""
    before = mx.get_cache_memory()
    mx.clear_cache()
    _trim_c_heap()
    return max(0, before - mx.get_cache_memory())


@functools.cache
def _glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def _trim_c_heap() -> None:
    """Give the C heap's free pages back to the OS after the pool was freed into it.

    MLX's CPU buffers come from malloc. A buffer that malloc placed inside the
    heap (a free region left by earlier allocations, not a fresh mmap) goes
    back to the heap's free list when the pool is cleared, and the OS still
    charges every page of it: a reclaim that U1 cannot see, in exactly the
    long-lived worker whose heap has such regions. `malloc_trim(0)` returns
    those free pages (glibc madvises the middle of the heap too); it costs
    well under a millisecond and a reclaim is rare (P4, failures, commands).
    """
    trim = _glibc_malloc_trim()
    if trim is not None:
        trim(0)


class MemorySampler:
    """The worker loop's handle on U1: `sample()` every step, `reclaim()` on command.

    Holds the pid read once in the worker process (spawned, never forked), so
    each sample is MLX's three counters plus one footprint read.
    """

    __slots__ = ("pid",)

    def __init__(self, pid: int | None = None):
        self.pid = os.getpid() if pid is None else pid

    def sample(self, held: Held = NOTHING_HELD, pool_returns: int = 0, pool_returned: int = 0) -> MemoryReading:
        return sample(self.pid, held, pool_returns, pool_returned)

    def usage(self) -> int:
        return sample(self.pid).usage

    def reclaim(self) -> int:
        return reclaim()
