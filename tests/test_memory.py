"""SPEC U1: a worker's usage = max(MLX active, footprint - MLX pool)."""

from __future__ import annotations

import os

import mlx.core as mx

from shared.probe import footprint
from shared.sizes import MiB
from worker.memory import MemorySampler, reclaim, sample


def test_u1_usage_is_max_of_active_and_footprint_minus_pool():
    reading = sample()
    assert reading.usage == max(reading.mlx_active, reading.footprint - reading.mlx_pool)
    assert reading.footprint > 0


def test_u1_footprint_is_the_probe_reading_not_rss():
    """RSS counts shared file pages (the mapped libraries); U1 wants private memory."""
    import psutil

    reading = sample()
    probe = footprint(os.getpid())
    assert abs(reading.footprint - probe) < 8 * MiB
    assert reading.footprint < psutil.Process().memory_info().rss


def test_u1_usage_follows_mlx_allocations():
    sampler = MemorySampler()
    before = sampler.sample()
    held = mx.ones((96 * MiB,), dtype=mx.uint8)
    mx.eval(held)
    during = sampler.sample()
    assert during.mlx_active - before.mlx_active == 96 * MiB
    assert during.usage - before.usage >= 90 * MiB
    del held
    sampler.reclaim()
    assert sampler.sample().usage - before.usage < 8 * MiB


def test_u1_pool_is_not_usage_and_reclaim_returns_it():
    """The allocator pool is memory MLX hands back on request: counting it as usage would
    make the guard evict models to free memory a reclaim gives back for free (SPEC P4)."""
    mx.clear_cache()
    small = [mx.ones((64 * 1024,), dtype=mx.uint8) for _ in range(64)]  # pooled sizes
    mx.eval(small)
    del small
    reading = sample()
    assert reading.mlx_pool > 0
    assert reading.usage == max(reading.mlx_active, reading.footprint - reading.mlx_pool)
    freed = reclaim()
    assert freed == reading.mlx_pool
    assert sample().mlx_pool == 0


def test_sampled_peak_survives_the_engines_per_chunk_resets():
    """The engine resets MLX's peak to measure each prefill chunk; the sample's peak must
    still be the process's high-water mark, or the supervisor would see a fake low peak."""
    from worker.memory import reset_peak

    big = mx.ones((48 * MiB,), dtype=mx.uint8)
    mx.eval(big)
    high = sample().mlx_peak
    del big
    reset_peak()
    assert mx.get_peak_memory() < high
    assert sample().mlx_peak == high
