"""SPEC C1-C14: the ceiling and everything derived from it."""

from __future__ import annotations

import pytest

from shared.host import HostCounters
from shared.sizes import GiB, MiB
from supervisor.policy.ceilings import (
    compute_ceilings,
    hot_cache_budget,
    limits_for,
    remedy,
    reserve_message,
    tier_preview,
    wired_limit_advice,
    wired_limit_suggestion,
    worker_limit,
)


def ceil(tier="balanced", *, total=32 * GiB, host="counters", own=4 * GiB, **kw):
    if host == "counters":
        host = HostCounters(total=total, free=8 * GiB, inactive=4 * GiB, file_backed=5 * GiB,
                            active=10 * GiB, compressor=True)
    return compute_ceilings(tier=tier, total=total, host=host, own=own, **kw)


def test_c1_static_is_total_minus_reserve():
    c = ceil("balanced", total=32 * GiB)
    assert c.reserve == 3 * GiB
    assert c.static == 29 * GiB
    assert not c.reserve_exceeds_total


@pytest.mark.parametrize("total", [4 * GiB, 6 * GiB, 0])
def test_c1_reserve_as_large_as_the_machine_is_one_byte_not_no_limit(total):
    """A 4 GiB machine on `safe`: reading static 0 as "no limit" would switch the
    guard off exactly where memory is scarcest."""
    c = ceil("safe", total=total, host=None)
    assert c.static == 1
    assert c.ceiling == 1 and c.binding == "static"
    assert c.reserve_exceeds_total
    assert "reserves 6 GiB but the machine has only" in reserve_message(c)


def test_c2_dynamic_from_full_counters():
    # own 4, free 8, inactive 4, file 5 -> file_active 1, inactive_term 5
    # aggressive: own_cpu = 4 (no GPU), other = (10 - 1 - 4) * 0.5 = 2.5
    c = ceil("aggressive", total=32 * GiB)
    assert c.reading == "counters"
    assert c.free == 8 * GiB and c.inactive == 5 * GiB
    assert c.other_apps == int(5 * GiB * 0.5)
    assert c.dynamic == 4 * GiB + 8 * GiB + 5 * GiB + int(2.5 * GiB) - c.reserve


def test_c2_own_gpu_is_not_taken_from_other_apps():
    c = ceil("aggressive", own=6 * GiB, own_gpu=4 * GiB)
    # own_cpu = 2 -> other = (10 - 1 - 2) * 0.5
    assert c.other_apps == int(7 * GiB * 0.5)


def test_c2_no_compressor_counts_no_other_apps():
    host = HostCounters(total=32 * GiB, free=8 * GiB, inactive=4 * GiB, active=10 * GiB, compressor=False)
    assert ceil("aggressive", host=host).other_apps == 0


def test_c2_only_available():
    host = HostCounters(total=32 * GiB, available=10 * GiB, active=20 * GiB)
    c = ceil("aggressive", host=host)
    assert c.reading == "available"
    assert (c.free, c.inactive, c.other_apps) == (10 * GiB, 0, 0)
    assert c.dynamic == 4 * GiB + 10 * GiB - c.reserve


@pytest.mark.parametrize("host", [None, HostCounters(total=32 * GiB)])
def test_c2_no_counters_at_all_dynamic_is_static(host):
    c = ceil("balanced", host=host)
    assert c.reading == "none"
    assert c.dynamic == c.static == c.ceiling


def test_c2_dynamic_floor_is_one_byte_when_other_apps_hold_the_reserve():
    """0 means "guard disabled"; other apps eating the reserve must tighten the
    guard to the maximum, not switch it off."""
    host = HostCounters(total=32 * GiB, free=0, inactive=0)
    c = ceil("safe", host=host, own=0)
    assert c.dynamic == 1 and c.ceiling == 1 and c.binding == "dynamic"


def test_c3_custom_ceiling_is_the_dynamic_term():
    c = ceil("custom", custom_ceiling=10 * GiB)
    assert c.dynamic == 10 * GiB and c.ceiling == 10 * GiB and c.binding == "dynamic"
    assert (c.free, c.inactive, c.other_apps) == (0, 0, 0)


def test_c3_custom_with_no_ceiling_is_not_a_candidate_and_not_disabled():
    c = ceil("custom", custom_ceiling=0)
    assert c.dynamic == 0
    assert c.ceiling == c.static == 30 * GiB and c.binding == "static"


def test_c3_custom_ceiling_above_ram_is_capped_by_static():
    c = ceil("custom", custom_ceiling=100 * GiB)
    assert c.ceiling == c.static and c.binding == "static"


def test_c4_gpu_cap_with_gpu_share_known_adds_cpu_side():
    c = ceil("custom", own=10 * GiB, own_gpu=7 * GiB, gpu_cap_raw=12 * GiB)
    assert c.gpu_cap == 15 * GiB
    assert c.ceiling == 15 * GiB and c.binding == "gpu_cap"


def test_c4_gpu_cap_without_gpu_share_adds_nothing():
    """Without the GPU ledger the CPU side is unknown; adding `own` would let the
    group grow past the GPU cap (Metal panics when an allocation exceeds it)."""
    c = ceil("custom", own=10 * GiB, own_gpu=0, gpu_cap_raw=12 * GiB)
    assert c.gpu_cap == 12 * GiB


def test_c4_no_gpu_cap_is_not_a_candidate():
    c = ceil("custom", gpu_cap_raw=0)
    assert c.gpu_cap == 0 and c.binding == "static"


def test_c5_guard_disabled_means_ceiling_zero():
    c = ceil("balanced", enabled=False, gpu_cap_raw=8 * GiB)
    assert (c.ceiling, c.binding, c.soft, c.hard) == (0, "", 0, 0)
    assert c.residency_ceiling == 0 and c.abort_limit == 0
    assert c.worker_ceiling == 0 and c.worker_abort_limit == 0


@pytest.mark.parametrize(
    "custom, gpu_raw, binding",
    [
        (30 * GiB, 0, "static"),       # tie static/dynamic: static first
        (20 * GiB, 20 * GiB, "dynamic"),  # tie dynamic/gpu_cap: dynamic first
        (25 * GiB, 20 * GiB, "gpu_cap"),
    ],
)
def test_c6_binding_is_the_first_component_equal_to_the_ceiling(custom, gpu_raw, binding):
    c = ceil("custom", custom_ceiling=custom, gpu_cap_raw=gpu_raw)
    assert c.binding == binding


@pytest.mark.parametrize(
    "binding, words",
    [("dynamic", "close other apps"), ("gpu_cap", "iogpu.wired_limit_mb"), ("static", "tier")],
)
def test_c6_remedy_fits_the_binding(binding, words):
    assert words in remedy(binding)


def test_c7_admission_ceiling_is_static_when_the_guard_is_off():
    """With the guard off, loads must still evict LRU models to fit; an
    admission ceiling of 0 once let a second model overcommit and thrash."""
    off = ceil("balanced", enabled=False)
    on = ceil("balanced")
    assert off.admission_ceiling == off.static and off.admission_binding == "static"
    assert on.admission_ceiling == on.ceiling


def test_c8_residency_ceiling_ignores_the_dynamic_term():
    """Right after a model unloads `dynamic` dips before the OS has the pages
    back; deciding residency on it once pushed a table to SSD for a model's
    whole life (35 -> 14 tok/s)."""
    host = HostCounters(total=32 * GiB, free=1 * GiB)
    c = ceil("balanced", host=host, gpu_cap_raw=20 * GiB)
    assert c.dynamic < c.residency_ceiling
    assert c.residency_ceiling == 20 * GiB
    assert ceil("balanced", host=host).residency_ceiling == c.static


def test_c9_admission_soft_target():
    c = ceil("balanced")
    assert c.admission_soft_target == int(c.admission_ceiling * 0.90)


def test_c10_abort_limit_ignores_the_dynamic_term():
    """A momentary dip of `dynamic` must not kill a nearly finished prefill."""
    host = HostCounters(total=32 * GiB, free=1 * GiB)
    c = ceil("balanced", host=host, own=10 * GiB, own_gpu=6 * GiB, gpu_cap_raw=20 * GiB)
    assert c.abort_limit == min(c.static, 20 * GiB + 4 * GiB)
    assert ceil("balanced", host=host).abort_limit == c.static


def test_c11_watermarks():
    c = ceil("custom", custom_ceiling=10 * GiB, soft_threshold=0.8, hard_threshold=0.9)
    assert c.soft == int(10 * GiB * 0.8) and c.hard == int(10 * GiB * 0.9)


def test_c12_empty_cache_reserves_nothing():
    """The seed's rule reserved cache used + 512 MiB, so an empty cache
    took 512 MiB off every worker's limits (1 byte under a 511 MiB ceiling)."""
    empty = ceil("custom", custom_ceiling=511 * MiB, hot_cache_max=GiB, hot_cache_used=0)
    assert empty.hot_cache_reserved == 0
    assert empty.worker_ceiling == empty.ceiling == 511 * MiB
    assert empty.worker_abort_limit == empty.abort_limit


def test_c12_reservation_is_the_bytes_the_caches_hold():
    c = ceil("custom", custom_ceiling=10 * GiB, hot_cache_max=2 * GiB, hot_cache_used=GiB)
    assert c.hot_cache_reserved == GiB
    assert c.worker_ceiling == 9 * GiB
    assert ceil("custom", custom_ceiling=10 * GiB).hot_cache_reserved == 0


def test_h2_budget_in_force_is_bounded_by_a_quarter_of_soft():
    """The default 1 GiB budget under a 511 MiB ceiling took every limit to 1 byte; H2 as of 2026-12-01."""
    small = ceil("custom", custom_ceiling=511 * MiB, hot_cache_max=GiB)
    assert small.hot_cache_budget == small.soft // 4 == int(511 * MiB * 0.90) // 4
    large = ceil("custom", custom_ceiling=64 * GiB, hot_cache_max=GiB)
    assert large.hot_cache_budget == GiB
    assert ceil("custom", custom_ceiling=10 * GiB, hot_cache_max=0).hot_cache_budget == 0
    assert hot_cache_budget(GiB, 0) == GiB  # guard off: no watermark bounds it


@pytest.mark.parametrize(
    "limit, others, expected",
    [(10, 0, 10), (10, 4, 6), (10, 9, 1), (10, 10, 10), (10, 99, 10), (0, 5, 0)],
)
def test_c12_worker_limit_subtracts_the_others_caches_never_down_to_nothing(limit, others, expected):
    """A cache as large as the limit itself is not subtracted (it is dropped, H3)."""
    assert worker_limit(limit, others) == expected


def test_limits_for_hands_every_g_value():
    c = ceil("aggressive", gpu_cap_raw=20 * GiB, hot_cache_max=GiB, hot_cache_used=100 * MiB)
    limits = limits_for(c, admission_paused=True, safe_zone_ratio=0.8, min_chunk_tokens=128,
                        max_concurrency=3)
    assert limits.hard_limit == c.worker_ceiling == c.ceiling - c.hot_cache_reserved
    assert limits.soft_limit == c.soft == int(c.ceiling * 0.95)  # the group's watermarks (P9)
    assert limits.hard_watermark == c.hard == int(c.ceiling * 0.98)
    assert limits.abort_limit == c.worker_abort_limit
    assert (limits.abort_margin, limits.prefill_headroom_safety) == (0.97, 0.97)
    assert (limits.safe_zone_ratio, limits.min_chunk_tokens) == (0.8, 128)
    assert (limits.ceiling, limits.static, limits.dynamic, limits.gpu_cap) == (
        c.ceiling, c.static, c.dynamic, c.gpu_cap)
    assert (limits.binding, limits.tier, limits.admission_paused, limits.max_concurrency) == (
        c.binding, "aggressive", True, 3)


def test_limits_for_guard_off_is_all_zero_limits():
    limits = limits_for(ceil("balanced", enabled=False), admission_paused=False)
    assert (limits.soft_limit, limits.hard_limit, limits.hard_watermark, limits.abort_limit,
            limits.ceiling) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    "desired, total, expected",
    [
        (20 * GiB, 32 * GiB, 20 * GiB),
        (32 * GiB, 32 * GiB, (32 * GiB - 32 * GiB // 20) // MiB * MiB),
        (500 * GiB, 512 * GiB, (512 * GiB - 512 * GiB // 20) // MiB * MiB),
        (20 * GiB + 12345, 64 * GiB, 20 * GiB),  # whole MiB
    ],
)
def test_c13_wired_limit_suggestion_never_within_5_percent_of_ram(desired, total, expected):
    """Wiring within a few GiB of RAM jetsammed the server during a large load,
    and a killed process strands its wired memory until reboot."""
    assert wired_limit_suggestion(desired, total) == expected


def test_c13_advice_shows_sysctl_command_when_cap_is_below():
    text = wired_limit_advice(20 * GiB, 32 * GiB, 16 * GiB)
    assert "sudo sysctl iogpu.wired_limit_mb=20480" in text
    assert wired_limit_advice(20 * GiB, 32 * GiB, 24 * GiB) == ""
    assert wired_limit_advice(20 * GiB, 32 * GiB, 0) == ""
    assert "less than 5%" in wired_limit_advice(20 * GiB, 32 * GiB, 31 * GiB)


def test_c14_tier_preview_every_tier():
    host = HostCounters(total=32 * GiB, free=8 * GiB, inactive=4 * GiB, active=10 * GiB)
    previews = tier_preview(host, own=4 * GiB, gpu_cap_raw=0, custom_ceiling=0)
    assert list(previews) == ["safe", "balanced", "aggressive", "custom"]
    for tier, p in previews.items():
        c = ceil(tier, host=host)
        assert (p.reserve_bytes, p.static_bytes, p.ceiling_bytes, p.binding) == (
            c.reserve, c.static, c.ceiling, c.binding)
        assert p.soft_bytes == c.soft and p.hard_bytes == c.hard
    custom = previews["custom"]
    assert (custom.free_bytes, custom.inactive_bytes, custom.other_apps_bytes, custom.dynamic_bytes) == (0, 0, 0, 0)
    assert custom.ceiling_bytes == custom.static_bytes


def test_c6_custom_tier_dynamic_binding_remedy_is_to_raise_the_custom_ceiling():
    """On custom the dynamic component is the user's own number (C3): telling
    them to close other apps would not raise it."""
    assert "custom ceiling" in remedy("dynamic", "custom")
    assert "close other apps" not in remedy("dynamic", "custom")
    assert "close other apps" in remedy("dynamic", "balanced")
