"""SPEC U1 (2026-12-01): a worker's usage = max(MLX active, footprint), the MLX pool included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from shared.probe import footprint
from shared.sizes import GiB, MiB
from worker.own_memory import MemorySampler, sample, u1_usage

REPO = Path(__file__).resolve().parent.parent


def test_u1_usage_is_max_of_active_and_footprint_pool_included():
    """Both sides of the max, and a buffer MLX keeps in its pool is not taken off usage: the
    pool is memory the OS charges (a reading that subtracts it sits below the footprint)."""
    assert u1_usage(3 * GiB, GiB) == 3 * GiB  # active above the footprint: the floor
    assert u1_usage(GiB, 3 * GiB) == 3 * GiB
    limit = mx.set_cache_limit(1 << 32)
    try:
        held = mx.ones((64 * MiB,), dtype=mx.uint8)
        mx.eval(held)
        del held  # into MLX's pool, not back to the OS
        reading = sample()
    finally:
        mx.set_cache_limit(limit)
    assert reading.mlx_pool >= 64 * MiB
    assert reading.usage >= reading.footprint > 0


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


_POOL_IN_THE_HEAP = """
import ctypes, json, sys
import mlx.core as mx
from shared.sizes import GiB, MiB
from worker.own_memory import reclaim, sample
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
mx.set_cache_limit(1 << 32)
if sys.argv[1] == "heap":
    libc.mallopt(-3, 256 * MiB)       # M_MMAP_THRESHOLD: the buffer comes from the heap, not an mmap
held = mx.ones((48 * MiB,), dtype=mx.uint8)
mx.eval(held)
pin = libc.malloc(4096)               # a live chunk above it: freeing the buffer cannot shrink the heap's top
del held
fat = sample()
returned = reclaim()
after = sample()
print(json.dumps({"fat": [fat.usage, fat.footprint, fat.mlx_active, fat.mlx_pool],
                  "after": [after.usage, after.mlx_pool], "returned": returned}))
"""


@pytest.mark.parametrize("placement", ["mmap", "heap"])
def test_u1_pool_counts_as_usage_and_reclaim_lowers_it(placement):
    """A fat pool is memory the OS sees as taken: usage must show it, and a
    reclaim (P4) must show as a lower usage, or the guard can neither see the
    pool nor see its reclaim work (SPEC U1 as changed on 2026-12-01).

    In a fresh process, so what earlier tests left in this one's C heap cannot
    decide where the buffer lands. `heap` is the case a long-lived worker meets
    (and this test met, now and then, in the full suite): the 48 MiB buffer sits
    inside the heap below a live chunk, so clearing MLX's pool only hands it to
    malloc's free list; the reclaim must still give the pages back."""
    out = subprocess.run([sys.executable, "-c", _POOL_IN_THE_HEAP, placement], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    usage, footprint_bytes, active, pool = got["fat"]
    assert pool >= 48 * MiB
    assert usage == max(active, footprint_bytes) and usage >= pool
    assert got["returned"] == pool
    assert got["after"][1] == 0
    assert usage - got["after"][0] >= 44 * MiB  # the reclaim shows


def test_sampled_peak_survives_the_engines_per_chunk_resets():
    """The engine resets MLX's peak to measure each prefill chunk; the sample's peak must
    still be the process's high-water mark, or the supervisor would see a fake low peak."""
    from worker.own_memory import reset_peak

    big = mx.ones((48 * MiB,), dtype=mx.uint8)
    mx.eval(big)
    high = sample().mlx_peak
    del big
    reset_peak()
    assert mx.get_peak_memory() < high
    assert sample().mlx_peak == high
