"""MLX's allocator limits inside a worker (SPEC M1, M2), against a fake MLX that records calls.

The macOS wiring (M2) is only ever exercised here, with a fake: on Linux the
worker never calls set_wired_limit.
"""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.sizes import GiB, MiB
from worker.allocator import AllocatorLimits, wired_suggestion


class FakeMx:
    """The three MLX setters, each returning the previous value as MLX does."""

    def __init__(self, memory: int = 48 * GiB, cache: int = 48 * GiB, wired_max: int = 0):
        self.memory, self.cache, self.wired_max = memory, cache, wired_max
        self.calls: list[tuple[str, int]] = []

    def set_memory_limit(self, n: int) -> int:
        self.calls.append(("memory", n))
        self.memory, old = n, self.memory
        return old

    def set_cache_limit(self, n: int) -> int:
        self.calls.append(("cache", n))
        self.cache, old = n, self.cache
        return old

    def set_wired_limit(self, n: int) -> int:
        if self.wired_max and n > self.wired_max:
            raise ValueError("above the recommended working set size")
        self.calls.append(("wired", n))
        return 0


def test_m1_hard_limit_and_pool_max_reach_mlx_and_follow_changes():
    mx = FakeMx()
    alloc = AllocatorLimits(mx, platform="linux")
    alloc.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB))
    assert (mx.memory, mx.cache) == (20 * GiB, 2 * GiB)
    calls = len(mx.calls)
    alloc.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB, admission_paused=True))
    assert len(mx.calls) == calls  # nothing MLX cares about changed: no call
    alloc.apply(Limits(hard_limit=18 * GiB, pool_max=GiB))
    assert (mx.memory, mx.cache) == (18 * GiB, GiB)


def test_m1_guard_off_puts_mlx_defaults_back():
    mx = FakeMx(memory=40 * GiB, cache=40 * GiB)
    alloc = AllocatorLimits(mx, platform="linux")
    alloc.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB))
    alloc.apply(Limits())
    assert (mx.memory, mx.cache) == (40 * GiB, 40 * GiB)


def test_m1_pool_max_never_raises_mlx_own_smaller_pool_limit():
    mx = FakeMx(cache=32 * MiB)  # MLX's CPU default
    AllocatorLimits(mx, platform="linux").apply(Limits(hard_limit=GiB, pool_max=2 * GiB))
    assert mx.cache == 32 * MiB


def test_m2_not_on_linux():
    mx = FakeMx()
    AllocatorLimits(mx, platform="linux", device_info={"memory_size": 64 * GiB}).apply(
        Limits(hard_limit=GiB, residency=40 * GiB))
    assert not [c for c in mx.calls if c[0] == "wired"]


def test_m2_macos_wires_min_of_residency_and_c13_suggestion():
    mx = FakeMx()
    info = {"memory_size": 64 * GiB, "max_recommended_working_set_size": 63 * GiB}
    alloc = AllocatorLimits(mx, platform="darwin", device_info=info, advise=pytest.fail)
    alloc.apply(Limits(residency=40 * GiB))
    assert ("wired", 40 * GiB) in mx.calls
    alloc.apply(Limits(residency=63 * GiB))  # C13: never within 5% of RAM
    assert mx.calls[-1] == ("wired", wired_suggestion(63 * GiB, 64 * GiB))
    assert wired_suggestion(63 * GiB, 64 * GiB) == (64 * GiB - 64 * GiB // 20) // MiB * MiB


def test_m2_kernel_cap_below_the_suggestion_wires_the_cap_and_advises_once():
    mx = FakeMx(wired_max=30 * GiB)
    said: list[str] = []
    info = {"memory_size": 64 * GiB, "max_recommended_working_set_size": 30 * GiB}
    alloc = AllocatorLimits(mx, platform="darwin", device_info=info, advise=said.append)
    alloc.apply(Limits(residency=40 * GiB))
    alloc.apply(Limits(residency=41 * GiB))
    assert [c for c in mx.calls if c[0] == "wired"] == [("wired", 30 * GiB)] * 2
    assert len(said) == 1 and "sudo sysctl iogpu.wired_limit_mb=40960" in said[0]


def test_m1_a_pool_over_the_cap_mlx_was_given_is_for_the_worker_to_return(caplog, monkeypatch):
    """Where an allocator does not hold its cache limit, the worker sees the pool past the cap
    and returns it itself; said once in the log. No cap of ours (pool_max 0), or the lab's
    stand-in for an allocator that ignores its limit, leaves the pool to the guard (P4)."""
    allocator = AllocatorLimits(FakeMx(cache=8 * GiB), platform="linux")
    assert not allocator.over_pool_cap(3 * GiB)  # no limits applied yet
    allocator.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB))
    assert not allocator.over_pool_cap(2 * GiB)
    assert allocator.over_pool_cap(2 * GiB + 1) and allocator.over_pool_cap(3 * GiB)
    assert sum("over its cache limit" in r.getMessage() for r in caplog.records) == 1
    allocator.apply(Limits(hard_limit=20 * GiB, pool_max=0))
    assert not allocator.over_pool_cap(3 * GiB)
    monkeypatch.setenv("MEMVISOR_NO_CACHE_LIMIT", "1")
    lab = AllocatorLimits(FakeMx(cache=8 * GiB), platform="linux")
    lab.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB))
    assert not lab.over_pool_cap(3 * GiB)
