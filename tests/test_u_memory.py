"""SPEC U1 (2026-12-01): a worker's usage = max(MLX active, footprint), the MLX pool included."""

from __future__ import annotations

import os

import mlx.core as mx

from shared.probe import footprint
from shared.sizes import MiB
from worker.memory import MemorySampler, reclaim, sample


def test_u1_usage_is_max_of_active_and_footprint_pool_included():
    reading = sample()
    assert reading.usage == max(reading.mlx_active, reading.footprint)
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


def test_u1_pool_counts_as_usage_and_reclaim_lowers_it():
    """A fat pool is memory the OS sees as taken: usage must show it, and a
    reclaim (P4) must show as a lower usage, or the guard can neither see the
    pool nor see its reclaim work (SPEC U1 as changed on 2026-12-01).

    One 48 MiB buffer: above glibc's largest mmap threshold (32 MiB), so
    freeing it returns the pages to the OS whatever the heap did before."""
    previous = mx.set_cache_limit(1 << 32)
    try:
        mx.clear_cache()
        held = mx.ones((48 * MiB,), dtype=mx.uint8)
        mx.eval(held)
        del held
        fat = sample()
        assert fat.mlx_pool >= 48 * MiB
        assert fat.usage == max(fat.mlx_active, fat.footprint) and fat.usage >= fat.mlx_pool
        assert reclaim() == fat.mlx_pool
        after = sample()
    finally:
        mx.set_cache_limit(previous)
    assert after.mlx_pool == 0
    assert fat.usage - after.usage >= 44 * MiB  # the reclaim shows


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
