"""MLX's allocator limits inside a worker (SPEC M1, M2), against a fake MLX that records calls.

The macOS wiring (M2) is only ever exercised here, with a fake: on Linux the
worker never calls set_wired_limit.
"""

from __future__ import annotations

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


class UnboundedPool(FakeMx):
    """MLX's CUDA allocator as ../shared/device-cuda.md found it: the limits are taken and
    returned, but the pool (its cache) grows past the cache limit all the same."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pool = 0

    def get_cache_memory(self) -> int:
        return self.pool

    def clear_cache(self) -> None:
        self.calls.append(("clear", self.pool))
        self.pool = 0


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


def test_m2_macos_wires_nothing_unless_handed_a_residency_ceiling():
    """M2 (2026-12-05): the supervisor hands residency 0 unless `[guard] wire_weights` opts in."""
    mx = FakeMx()
    info = {"memory_size": 64 * GiB, "max_recommended_working_set_size": 63 * GiB}
    alloc = AllocatorLimits(mx, platform="darwin", device_info=info)
    alloc.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB))
    alloc.apply(Limits(hard_limit=18 * GiB, pool_max=2 * GiB))
    assert not [c for c in mx.calls if c[0] == "wired"] and alloc.wired == 0


def test_m2_macos_wires_min_of_residency_and_c13_suggestion_and_unwires_when_told():
    mx = FakeMx()
    info = {"memory_size": 64 * GiB, "max_recommended_working_set_size": 63 * GiB}
    alloc = AllocatorLimits(mx, platform="darwin", device_info=info)
    alloc.apply(Limits(residency=40 * GiB))
    assert ("wired", 40 * GiB) in mx.calls
    alloc.apply(Limits(residency=63 * GiB))  # C13: never within 5% of RAM
    assert mx.calls[-1] == ("wired", wired_suggestion(63 * GiB, 64 * GiB))
    assert wired_suggestion(63 * GiB, 64 * GiB) == (64 * GiB - 64 * GiB // 20) // MiB * MiB
    alloc.apply(Limits())  # wire_weights turned off (a reload): the residency set goes
    assert mx.calls[-1] == ("wired", 0) and alloc.wired == 0


def test_m2_kernel_cap_below_the_suggestion_wires_the_cap():
    mx = FakeMx(wired_max=30 * GiB)
    info = {"memory_size": 64 * GiB, "max_recommended_working_set_size": 30 * GiB}
    alloc = AllocatorLimits(mx, platform="darwin", device_info=info)
    alloc.apply(Limits(residency=40 * GiB))
    alloc.apply(Limits(residency=41 * GiB))
    assert [c for c in mx.calls if c[0] == "wired"] == [("wired", 30 * GiB)] * 2


def test_m1_a_pool_over_its_cap_is_returned_by_the_worker_at_the_step_boundary_and_counted():
    """Where set_cache_limit does not bound the pool (CUDA), a step boundary returns it."""
    mx = UnboundedPool(cache=40 * GiB)
    alloc = AllocatorLimits(mx, platform="linux")
    alloc.apply(Limits(hard_limit=20 * GiB, pool_max=2 * GiB))
    mx.pool = 2 * GiB  # at the cap: kept, as MLX would keep it
    assert alloc.hold_pool() == 0 and ("clear", 2 * GiB) not in mx.calls
    mx.pool = 3 * GiB
    assert alloc.hold_pool() == 3 * GiB and mx.pool == 0
    mx.pool = 5 * GiB
    alloc.hold_pool()
    assert (alloc.pool_returns, alloc.pool_returned) == (2, 8 * GiB)


def test_m1_the_pool_cap_follows_the_limits_and_mlx_own_smaller_default():
    mx = UnboundedPool(cache=32 * MiB)  # MLX's CPU default is below pool_max: that is the cap
    alloc = AllocatorLimits(mx, platform="linux")
    mx.pool = 64 * MiB
    assert alloc.hold_pool() == 0, "never told a cap: nothing to hold the pool to"
    alloc.apply(Limits(hard_limit=GiB, pool_max=2 * GiB))
    assert alloc.pool_cap == 32 * MiB and alloc.hold_pool() == 64 * MiB
    alloc.apply(Limits())  # guard off: MLX's own default again, still the cap
    mx.pool = 33 * MiB
    assert alloc.pool_cap == 32 * MiB and alloc.hold_pool() == 33 * MiB


def test_m1_the_lab_allocator_that_ignores_its_limit_keeps_its_pool(monkeypatch):
    """The pressure lab's P4 scenario stands for an allocator no limit bounds: the worker's own
    return is part of M1's bound, so it is off there too and P4's reclaim has a pool to return."""
    from worker.allocator import NO_CACHE_LIMIT_ENV

    monkeypatch.setenv(NO_CACHE_LIMIT_ENV, "1")
    mx = UnboundedPool()
    alloc = AllocatorLimits(mx, platform="linux")
    alloc.apply(Limits(hard_limit=GiB, pool_max=64 * MiB))
    mx.pool = GiB
    assert alloc.hold_pool() == 0 and mx.pool == GiB and alloc.pool_returns == 0


def test_m1_pool_returns_travel_in_the_memory_sample():
    from worker.own_memory import Held, sample

    reading = sample(held=Held(batch_bytes=4 * MiB, batch_live_bytes=MiB, batch_relayouts=3),
                     pool_returns=2, pool_returned=3 * GiB)
    assert (reading.batch_bytes, reading.batch_live_bytes, reading.batch_relayouts) == (4 * MiB, MiB, 3)
    assert (reading.pool_returns, reading.pool_returned) == (2, 3 * GiB)
