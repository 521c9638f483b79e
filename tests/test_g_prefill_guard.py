"""SPEC G1-G3: the prefill guard's pure arithmetic, one edge per test."""

from __future__ import annotations

import msgspec
import pytest

from shared.limits import Limits
from shared.sizes import GiB, MiB
from worker.prefill_guard import (
    COST_PAD,
    DEVICE,
    Limit,
    PrefillCost,
    abort_binding,
    admission_peak,
    after_chunk,
    chunk_bytes,
    chunk_target,
    device_limits,
    estimate_prefill_peak,
    floor_room,
    next_chunk,
    padded_chunk_bytes,
    prefill_limit,
    preflight,
    rejection_message,
)

# A 10 GiB ceiling on the balanced tier (T4: soft 0.90, hard 0.95, headroom 0.92, margin 0.93).
LIMITS = Limits(
    soft_limit=9 * GiB,
    hard_limit=10 * GiB,
    hard_watermark=int(9.5 * GiB),
    abort_limit=12 * GiB,
    abort_margin=0.93,
    prefill_headroom_safety=0.92,
    safe_zone_ratio=0.89,
    min_chunk_tokens=256,
    ceiling=10 * GiB,
    static=12 * GiB,
    dynamic=10 * GiB,
    binding="dynamic",
)
COST = PrefillCost(kv_per_token=64 * 1024, chunk_per_token=192 * 1024)  # 64 KiB KV, 192 KiB more in flight
MAX_CHUNK = 2048


def _peak(tokens: int) -> int:
    """What G1 compares with its limit (the estimate, the chunk in flight padded as G2 pads it)."""
    return admission_peak(tokens, COST, LIMITS.min_chunk_tokens)


# ---------------------------------------------------------------- G1 preflight


def test_g1_guard_off_lets_everything_through():
    """0 limits mean no limit (C5): a disabled guard must never reject."""
    off = Limits()
    verdict = preflight(off, usage=100 * GiB, tokens=10**6, cost=COST)
    assert verdict.verdict == "fits"


def test_g1_fits_under_hard_limit():
    verdict = preflight(LIMITS, usage=5 * GiB, tokens=1000, cost=COST)
    assert verdict.verdict == "fits"
    assert verdict.estimated_bytes == 5 * GiB + _peak(1000)


def test_g1_peak_counts_kv_for_every_token_but_activations_for_one_floor_chunk():
    """A chunked prefill holds one chunk's activations at a time, and G2 can shrink chunks
    down to the floor, so feasibility is judged at the floor chunk size."""
    floor = LIMITS.min_chunk_tokens
    tokens = 40 * floor
    expected = tokens * COST.kv_per_token + floor * COST.chunk_per_token
    assert estimate_prefill_peak(tokens, COST, floor) == pytest.approx(expected, abs=1)


def test_g1_prompt_that_fits_only_in_small_chunks_needs_no_eviction():
    """Stopping someone's idle model to run bigger chunks would trade their model for speed."""
    tokens = 4096
    full_chunks = estimate_prefill_peak(tokens, COST, MAX_CHUNK)
    usage = 10 * GiB - (full_chunks + _peak(tokens)) // 2  # between the two estimates
    verdict = preflight(LIMITS, usage=usage, tokens=tokens, cost=COST, own_usage=1 * GiB)
    assert verdict.verdict == "fits"


def test_g1_admits_only_what_g2_will_run_under_the_same_limit():
    """G1 counts the chunk in flight as G2 counts it (padded): a prompt G1 lets in right at
    the limit gets its chunks from G2 instead of an abort at the first one."""
    limits = Limits(hard_limit=1 * GiB, abort_limit=1 * GiB, abort_margin=1.0, prefill_headroom_safety=1.0,
                    min_chunk_tokens=256, static=1 * GiB)
    for tokens in (10, 256, 3000):
        usage = 1 * GiB - admission_peak(tokens, COST, 256)
        assert preflight(limits, usage=usage, tokens=tokens, cost=COST).verdict == "fits"
        assert next_chunk(limits, usage=usage, remaining=tokens, cost=COST, max_chunk=256).tokens > 0
    # ... and asks no more than the pad on one floor chunk beyond the estimate
    extra = admission_peak(3000, COST, 256) - estimate_prefill_peak(3000, COST, 256)
    assert 0 < extra <= (COST_PAD - 1) * chunk_bytes(COST, 2560, 256) + 1


def test_g1_over_hard_limit_asks_for_eviction_first():
    usage = 10 * GiB - _peak(1000) + 1  # one byte over
    verdict = preflight(LIMITS, usage=usage, tokens=1000, cost=COST,
                        own_usage=1 * GiB)
    assert verdict.verdict == "evict"
    assert verdict.need_bytes == 1
    assert verdict.limit_bytes == 10 * GiB
    assert verdict.binding == "dynamic"


def test_g1_still_over_after_the_one_retry_rejects_with_numbers():
    usage = 10 * GiB - _peak(1000) + 1
    verdict = preflight(LIMITS, usage=usage, tokens=1000, cost=COST,
                        own_usage=1 * GiB, retried=True)
    assert verdict.verdict == "reject"
    assert verdict.estimated_bytes == usage + _peak(1000)
    assert verdict.limit_bytes == 10 * GiB
    assert verdict.binding == "dynamic"


def test_g1_hopeless_prompt_rejected_without_evicting_other_models():
    """Stopping other people's models cannot make room for a prompt larger than the limit
    minus this worker's own usage, so it must not cost them their models."""
    tokens = 100_000  # ~6 GiB of KV
    verdict = preflight(LIMITS, usage=6 * GiB, tokens=tokens, cost=COST,
                        own_usage=5 * GiB)
    assert verdict.verdict == "reject"


def test_g1_abort_limit_times_margin_binds_when_tighter_than_hard():
    limits = Limits(hard_limit=10 * GiB, abort_limit=10 * GiB, abort_margin=0.9,
                    static=10 * GiB, binding="static")
    assert prefill_limit(limits).bytes == 9 * GiB
    usage = 9 * GiB - _peak(100) + 1
    verdict = preflight(limits, usage=usage, tokens=100, cost=COST, retried=True)
    assert verdict.verdict == "reject"
    assert verdict.limit_bytes == 9 * GiB
    assert verdict.binding == "static"


def test_g1_gpu_cap_named_when_it_sets_the_abort_limit():
    limits = Limits(hard_limit=20 * GiB, abort_limit=8 * GiB, abort_margin=1.0,
                    static=20 * GiB, gpu_cap=8 * GiB, binding="static")
    assert prefill_limit(limits).binding == "gpu_cap"


def test_g1_rejection_message_names_binding_and_remedy():
    text = rejection_message(11 * GiB, 10 * GiB, "dynamic")
    assert "11 GiB" in text and "10 GiB" in text
    assert "dynamic" in text and "close other applications" in text
    assert "iogpu.wired_limit_mb" in rejection_message(1, 1, "gpu_cap")


# ---------------------------------------------------------------- G2 chunking


def test_g2_target_is_min_of_hard_headroom_and_abort_margin():
    target = chunk_target(LIMITS)
    assert target.bytes == min(int(10 * GiB * 0.92), int(12 * GiB * 0.93))
    tight_abort = Limits(hard_limit=10 * GiB, abort_limit=9 * GiB, abort_margin=0.9,
                         prefill_headroom_safety=0.95, static=9 * GiB)
    assert chunk_target(tight_abort).bytes == int(9 * GiB * 0.9)


def test_g2_below_safe_zone_runs_full_chunks():
    safe = int(LIMITS.soft_limit * LIMITS.safe_zone_ratio)
    plan = next_chunk(LIMITS, usage=safe - 1, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == MAX_CHUNK


def test_g2_last_chunk_is_what_remains():
    plan = next_chunk(LIMITS, usage=1 * GiB, remaining=300, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == 300


def test_g2_above_safe_zone_chunk_shrinks_with_headroom():
    safe = int(LIMITS.soft_limit * LIMITS.safe_zone_ratio)
    target = chunk_target(LIMITS).bytes
    sizes = [
        next_chunk(LIMITS, usage=u, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK).tokens
        for u in (safe + 1, (safe + target) // 2, target - 300 * MiB)
    ]
    assert MAX_CHUNK > sizes[0] >= sizes[1] >= sizes[2] >= LIMITS.min_chunk_tokens
    assert sizes[0] > sizes[2]


def test_g2_chunk_never_exceeds_what_padded_cost_says_fits():
    """Even in the safe zone a chunk must not outgrow the headroom: a huge per-token cost
    (long context, big vocab) caps the chunk below the full size."""
    target = chunk_target(LIMITS).bytes
    usage = 1 * GiB
    heavy = PrefillCost(kv_per_token=1 * MiB, chunk_per_token=8 * MiB)
    plan = next_chunk(LIMITS, usage=usage, remaining=10_000, cost=heavy, max_chunk=MAX_CHUNK)
    assert LIMITS.min_chunk_tokens <= plan.tokens < MAX_CHUNK
    assert chunk_bytes(heavy, 0, plan.tokens) * COST_PAD <= target - usage
    assert chunk_bytes(heavy, 0, plan.tokens + 1) * COST_PAD > target - usage


def test_g2_floor_is_min_chunk_tokens_when_it_still_fits():
    target = chunk_target(LIMITS).bytes
    usage = target - padded_chunk_bytes(COST, 0, 300)  # room for 300 tokens: proportional shrink says fewer
    plan = next_chunk(LIMITS, usage=usage, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == LIMITS.min_chunk_tokens


def test_g2_floor_that_does_not_fit_aborts():
    """Below the floor, tiny chunks would crawl toward the limit; abort instead of pushing over."""
    target = chunk_target(LIMITS).bytes
    usage = target - padded_chunk_bytes(COST, 0, 100)  # room for 100 tokens, floor is 256
    plan = next_chunk(LIMITS, usage=usage, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == 0
    assert plan.limit_bytes == target
    assert plan.estimated_bytes > target


def test_g2_floor_that_does_not_fit_asks_for_room_as_g1_does_with_the_shortfall():
    """G2 (2026-12-05): the floor chunk asks the supervisor before refusing; `need_bytes` means
    what G1's does: usage + the chunk's padded peak - its limit."""
    target = chunk_target(LIMITS).bytes
    usage = target - padded_chunk_bytes(COST, 0, 100)
    plan = next_chunk(LIMITS, usage=usage, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    verdict = floor_room(plan, usage, own_usage=GiB, retried=False)
    assert verdict.verdict == "evict"
    assert verdict.need_bytes == usage + padded_chunk_bytes(COST, 0, 256) - target > 0
    assert (verdict.estimated_bytes, verdict.limit_bytes, verdict.binding) == (
        plan.estimated_bytes, target, "dynamic")


@pytest.mark.parametrize(("own", "retried"), [(GiB, True), (None, False)])
def test_g2_floor_refuses_once_it_asked_or_when_no_eviction_could_help(own, retried):
    """Asked once already, or this worker alone (with the chunk) over the target: the refusal."""
    target = chunk_target(LIMITS).bytes
    usage = target - padded_chunk_bytes(COST, 0, 100)
    own = usage if own is None else own  # every byte of the usage is this worker's own
    plan = next_chunk(LIMITS, usage=usage, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    verdict = floor_room(plan, usage, own_usage=own, retried=retried)
    assert (verdict.verdict, verdict.need_bytes) == ("reject", 0)
    assert (verdict.estimated_bytes, verdict.limit_bytes) == (plan.estimated_bytes, target)


def test_g2_floor_shrinks_to_the_tokens_left():
    target = chunk_target(LIMITS).bytes
    usage = target - padded_chunk_bytes(COST, 0, 100)
    plan = next_chunk(LIMITS, usage=usage, remaining=50, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == 50


def test_g2_usage_already_over_target_aborts():
    plan = next_chunk(LIMITS, usage=11 * GiB, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == 0


def test_g2_guard_off_runs_full_chunks_whatever_the_usage():
    plan = next_chunk(Limits(), usage=100 * GiB, remaining=10_000, cost=COST, max_chunk=MAX_CHUNK)
    assert plan.tokens == MAX_CHUNK


# ---------------------------------------------------------------- G3 after each chunk


@pytest.mark.parametrize(
    "usage, expected",
    [
        (1 * GiB, "ok"),
        (9 * GiB, "ok"),              # at soft is not over it
        (9 * GiB + 1, "over_soft"),   # only logs
        (12 * GiB, "over_soft"),      # at the abort limit is not over it
        (12 * GiB + 1, "over_abort"),
    ],
)
def test_g3_after_chunk_levels(usage, expected):
    assert after_chunk(LIMITS, usage) == expected


def test_g3_guard_off_never_aborts():
    assert after_chunk(Limits(), 10**15) == "ok"


# ---------------------------------------------------------------- G1-G3 on a discrete device's pool (SPEC D)

# The host pool of a CUDA machine with room to spare; the device pool's watermarks (the group's
# MLX active + pool) at 18 and 19 GiB of a 20 GiB device ceiling.
ON_DEVICE = msgspec.structs.replace(LIMITS, device_soft=18 * GiB, device_hard=19 * GiB)


def test_g1_d_device_limits_put_the_device_watermarks_in_the_host_limits_places():
    d = device_limits(ON_DEVICE)
    assert prefill_limit(d) == Limit(19 * GiB, DEVICE)  # G1: the device hard watermark
    assert chunk_target(d).bytes == int(19 * GiB * ON_DEVICE.prefill_headroom_safety)  # G2
    assert chunk_target(d).binding == DEVICE
    assert (d.soft_limit, d.abort_limit) == (18 * GiB, 19 * GiB)  # G3: over soft logs, over hard aborts


def test_g1_d_a_prefill_that_fits_the_host_but_not_the_device_is_refused_naming_the_device_pool():
    """Host usage on CUDA is the footprint alone: the host limits would let any prompt through."""
    tokens = 20_000  # ~1.2 GiB of KV plus a chunk in flight
    assert preflight(ON_DEVICE, usage=2 * GiB, tokens=tokens, cost=COST).verdict == "fits"
    d = device_limits(ON_DEVICE)
    verdict = preflight(d, usage=int(18.5 * GiB), tokens=tokens, cost=COST, own_usage=int(18.5 * GiB))
    assert verdict.verdict == "reject" and verdict.binding == DEVICE and verdict.limit_bytes == 19 * GiB
    message = rejection_message(verdict.estimated_bytes, verdict.limit_bytes, verdict.binding)
    assert "of device memory" in message and "device pool's limit is 19 GiB" in message
    evict = preflight(d, usage=int(18.5 * GiB), tokens=tokens, cost=COST, own_usage=GiB)
    assert evict.verdict == "evict" and evict.need_bytes == evict.estimated_bytes - 19 * GiB


def test_g3_d_over_the_device_hard_watermark_aborts_naming_the_device():
    d = device_limits(ON_DEVICE)
    assert after_chunk(d, int(18.5 * GiB)) == "over_soft"
    assert after_chunk(d, 19 * GiB + 1) == "over_abort"
    assert abort_binding(d) == DEVICE
