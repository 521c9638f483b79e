"""SPEC D2-D5: the discrete device pool's reserve, ceiling, level and admission.

Most tables use a 24 GiB device. The admission tables use the custom tier
with a 20 GiB device ceiling (reserve 4 GiB), custom thresholds 0.90/0.97:
device soft 18 GiB, the A1 evict target.
"""

from __future__ import annotations

import msgspec
import pytest

from shared.memory import MemoryReading
from shared.sizes import GiB, MiB
from supervisor.config import guard_settings
from supervisor.config_file import ConfigError, parse_config
from supervisor.policy import admission, pressure
from supervisor.policy.device import (
    DEVICE_BINDINGS,
    DEVICE_EMERGENCY_MARGIN,
    DEVICE_EMERGENCY_TICKS,
    INSUFFICIENT_MEMORY,
    MODEL_TOO_LARGE,
    admit_device_load,
    compute_device_ceilings,
    device_emergency,
    device_level,
    device_remedy,
    device_reserve,
    device_reserve_message,
    device_tier_preview,
    worse_level,
)
from supervisor.policy.group import WorkerGroup
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.tiers import TIERS

TOTAL = 24 * GiB


def dev(tier="balanced", *, total=TOTAL, group=4 * GiB, others=0, free="auto", **kw):
    """Device ceilings; `free` defaults to what others and the group leave."""
    if free == "auto":
        free = total - group - others
    return compute_device_ceilings(tier=tier, total=total, free=free, group_bytes=group, **kw)


def w(name: str, **kw) -> WorkerRecord:
    kw.setdefault("model", f"m-{name}")
    return WorkerRecord(worker=name, memory=MemoryReading(usage=256 * MiB, footprint=256 * MiB), **kw)


def held_by(workers: list[WorkerRecord], held: dict[str, int]) -> WorkerGroup:
    """The group of these workers, each holding `held[id]` device bytes (D1; 0 when absent)."""
    return WorkerGroup(Snapshot(now=0.0, workers=[msgspec.structs.replace(x, device_bytes=held.get(x.worker, 0))
                                                  for x in workers]))


CUSTOM20 = {"custom_device_ceiling": 20 * GiB}


def custom(group: int, others: int = 0, **kw):
    return dev("custom", group=group, others=others, **CUSTOM20, **kw)


# -- D2 device reserve ---------------------------------------------------------


def test_d2_reserve_safe_clamps_to_1gib():
    assert device_reserve("safe", 8 * GiB) == 1 * GiB  # 10% = 0.8 GiB


@pytest.mark.parametrize(
    "tier, total, expected",
    [
        ("safe", 24 * GiB, int(0.10 * 24 * GiB)),
        ("safe", 141 * GiB, 8 * GiB),                # clamped down
        ("balanced", 8 * GiB, 512 * MiB),            # 5% = 410 MiB, clamped up
        ("balanced", 24 * GiB, int(0.05 * 24 * GiB)),
        ("balanced", 141 * GiB, 4 * GiB),
        ("aggressive", 8 * GiB, 256 * MiB),          # 2% = 164 MiB, clamped up
        ("aggressive", 80 * GiB, int(0.02 * 80 * GiB)),
        ("aggressive", 141 * GiB, 2 * GiB),
    ],
)
def test_d2_reserve_is_clamped_share_of_the_device(tier, total, expected):
    assert device_reserve(tier, total) == expected


def test_d2_custom_reserve_is_what_the_device_has_beyond_the_custom_ceiling():
    assert device_reserve("custom", 24 * GiB, 20 * GiB) == 4 * GiB


def test_d2_custom_unset_falls_back_to_balanced():
    assert device_reserve("custom", 24 * GiB) == device_reserve("balanced", 24 * GiB)


def test_d2_custom_ceiling_above_the_device_reserves_nothing():
    """Floored at 0: device static is then the whole device, never more."""
    assert device_reserve("custom", 24 * GiB, 100 * GiB) == 0
    assert dev("custom", custom_device_ceiling=100 * GiB).static == 24 * GiB


def test_d2_custom_device_ceiling_is_ignored_on_other_tiers():
    assert device_reserve("safe", 24 * GiB, 20 * GiB) == device_reserve("safe", 24 * GiB)


@pytest.mark.parametrize("name, same_as", [(" Safe ", "safe"), ("AGGRESSIVE", "aggressive")])
def test_d2_the_device_pool_reads_the_tier_normalised_where_it_entered(name, same_as):
    """T2 happens once, at the edge (here the config); the device pool gets a Tier."""
    tier = guard_settings(parse_config(f'[guard]\ntier = "{name}"')).tier
    assert device_reserve(tier, 24 * GiB) == device_reserve(same_as, 24 * GiB)
    assert dev(tier).tier == same_as


# -- D3 device ceiling -----------------------------------------------------------


def test_d3_no_device_is_none_and_every_helper_reads_it_as_no_device():
    assert dev(total=0, free=0, group=0) is None
    assert device_level(99 * GiB, None) == "ok"
    assert device_emergency(99 * GiB, None, 5) == (0, False)
    assert admit_device_load(None, held_by([w("a")], {"a": GiB}), "m", 99 * GiB).admitted
    assert device_reserve_message(None) == ""


def test_d3_ceiling_is_static_when_nothing_else_holds_the_device():
    c = dev("balanced", group=6 * GiB)
    assert c.reserve == int(1.2 * GiB) and c.static == TOTAL - c.reserve
    assert c.dynamic == c.static  # free 18 + group 6 - reserve
    assert c.ceiling == c.static and c.binding == "device_static" and c.others == 0


def test_d3_binding_device_others_when_other_processes_hold_memory():
    c = dev("balanced", group=6 * GiB, others=5 * GiB)
    assert c.others == 5 * GiB and c.free == 13 * GiB
    assert c.dynamic == 13 * GiB + 6 * GiB - c.reserve
    assert c.ceiling == c.dynamic < c.static and c.binding == "device_others"
    assert "other processes on the GPU" in device_remedy(c.binding, c.tier)


def test_d3_reserve_as_large_as_the_device_is_one_byte_not_no_limit():
    """A 768 MiB device on `safe` (reserve 1 GiB): 0 would switch the guard off."""
    c = dev("safe", total=768 * MiB, group=0)
    assert c.reserve == 1 * GiB and c.reserve_exceeds_total
    assert c.static == 1 and c.ceiling == 1 and c.binding == "device_static"
    assert "reserves 1 GiB of device memory but the device has only 768 MiB" in device_reserve_message(c)


def test_d3_free_reading_zero_floors_dynamic_to_one_byte():
    """A full device (others hold it all) is a reading, not "unknown": the guard stays on."""
    c = dev("balanced", group=0, free=0)
    assert c.free_known and c.dynamic == 1 and c.ceiling == 1
    assert c.binding == "device_others" and c.others == TOTAL


def test_d3_no_free_reading_dynamic_falls_back_to_static():
    c = dev("balanced", free=None)
    assert not c.free_known and c.free == 0 and c.others == 0
    assert c.dynamic == c.static == c.ceiling and c.binding == "device_static"


def test_d3_readings_that_overlap_never_raise_the_ceiling_above_static():
    """NVML's free and per-process bytes are sampled apart: free + group may exceed total."""
    c = dev("balanced", group=6 * GiB, free=20 * GiB)
    assert c.others == 0 and c.dynamic > c.static and c.ceiling == c.static


def test_d3_guard_off_ceiling_zero_admission_on_static():
    c = dev("balanced", group=6 * GiB, others=5 * GiB, enabled=False)
    assert c.ceiling == 0 and c.binding == "" and (c.soft, c.hard) == (0, 0)
    assert c.admission_ceiling == c.static and c.admission_binding == "device_static"


@pytest.mark.parametrize("tier, soft, hard", [("safe", 0.85, 0.95), ("balanced", 0.90, 0.95),
                                              ("aggressive", 0.95, 0.98), ("custom", 0.90, 0.97)])
def test_d3_watermarks_are_the_tier_thresholds_times_the_device_ceiling(tier, soft, hard):
    c = dev(tier)
    assert (c.soft_threshold, c.hard_threshold) == (soft, hard)
    assert c.soft == int(c.ceiling * soft) and c.hard == int(c.ceiling * hard)
    assert c.admission_soft_target == c.soft


def test_d3_threshold_overrides_follow_t5():
    c = dev("balanced", soft_threshold=0.8, hard_threshold=0.9)
    assert c.soft == int(c.ceiling * 0.8) and c.hard == int(c.ceiling * 0.9)
    legacy = dev("aggressive", soft_threshold=0.85, hard_threshold=0.95)  # legacy defaults
    assert (legacy.soft_threshold, legacy.hard_threshold) == (0.95, 0.98)


def test_d3_custom_device_ceiling_is_device_static():
    c = custom(group=2 * GiB)
    assert c.reserve == 4 * GiB and c.static == 20 * GiB == c.ceiling
    assert c.binding == "device_static"
    assert "custom_device_ceiling" in device_remedy(c.binding, c.tier)


def test_d3_custom_device_ceiling_still_sees_other_processes():
    """Device memory another process holds cannot be compressed away, even on custom."""
    c = custom(group=2 * GiB, others=6 * GiB)
    assert c.ceiling == 20 * GiB - 6 * GiB and c.binding == "device_others"


@pytest.mark.parametrize(
    "binding, tier, words",
    [
        ("device_static", "balanced", "choose a tier that keeps less device memory in reserve"),
        ("device_static", "custom", "set or raise [guard] custom_device_ceiling"),
        ("device_others", "balanced", "other processes on the GPU (nvidia-smi"),
        ("device_others", "custom", "other processes on the GPU (nvidia-smi"),
        ("", "balanced", ""),
    ],
)
def test_d3_remedy_in_words(binding, tier, words):
    assert words in device_remedy(binding, tier)
    assert binding in DEVICE_BINDINGS


# -- D4 level and emergency ------------------------------------------------------


@pytest.mark.parametrize(
    "usage, level",
    [(0, "ok"), (18 * GiB - 1, "ok"), (18 * GiB, "soft"), (int(20 * GiB * 0.97) - 1, "soft"),
     (int(20 * GiB * 0.97), "hard"), (25 * GiB, "hard")],
)
def test_d4_level_is_p1_on_the_device_watermarks(usage, level):
    assert device_level(usage, custom(group=2 * GiB)) == level


def test_d4_level_is_ok_with_the_guard_off():
    assert device_level(30 * GiB, dev("balanced", enabled=False)) == "ok"


def test_d4_emergency_counts_consecutive_ticks_at_or_over_the_device_ceiling():
    c = custom(group=2 * GiB)
    first = device_emergency(20 * GiB, c, 0)
    assert first == (1, False)
    assert device_emergency(20 * GiB, c, first.over_ceiling_ticks) == (2, True)


def test_d4_emergency_at_once_two_gib_over_the_device_ceiling():
    c = custom(group=2 * GiB)
    assert device_emergency(22 * GiB, c, 0) == (1, True)
    assert device_emergency(22 * GiB - 1, c, 0) == (1, False)


def test_d4_emergency_count_resets_below_the_device_ceiling():
    assert device_emergency(20 * GiB - 1, custom(group=2 * GiB), 7) == (0, False)


def test_d4_recheck_may_reset_but_never_advances_the_count():
    c = custom(group=2 * GiB)
    assert device_emergency(20 * GiB, c, 1, recheck=True) == (1, False)
    assert device_emergency(GiB, c, 1, recheck=True) == (0, False)


def test_d4_guard_off_never_counts():
    assert device_emergency(30 * GiB, dev("balanced", enabled=False), 3) == (0, False)


def test_d4_emergency_numbers_are_p2s():
    assert DEVICE_EMERGENCY_MARGIN == pressure.EMERGENCY_MARGIN
    assert DEVICE_EMERGENCY_TICKS == pressure.EMERGENCY_TICKS


@pytest.mark.parametrize(
    "host, device, group",
    [("ok", "ok", "ok"), ("ok", "soft", "soft"), ("ok", "hard", "hard"), ("soft", "ok", "soft"),
     ("soft", "soft", "soft"), ("soft", "hard", "hard"), ("hard", "ok", "hard"),
     ("hard", "soft", "hard"), ("hard", "hard", "hard")],
)
def test_d4_group_level_is_the_worse_of_the_two_pools(host, device, group):
    assert worse_level(host, device) == group


def test_d4_group_device_bytes_counts_live_workers_only():
    workers = [w("ready"), w("draining", state="draining"), w("loading", state="loading"),
               w("dead", state="dead"), w("stopped", state="stopped"), w("unmapped")]
    held = {"ready": 1 * GiB, "draining": 2 * GiB, "loading": 4 * GiB, "dead": 8 * GiB, "stopped": 16 * GiB}
    assert held_by(workers, held).device_bytes == 7 * GiB


# -- D5 admission on device bytes ------------------------------------------------


def test_d5_a1_a2_evicts_lru_idle_by_device_bytes_down_to_the_device_soft_target():
    workers = [w("old", last_access=1), w("mid", last_access=2), w("new", last_access=3)]
    held = {"old": 6 * GiB, "mid": 6 * GiB, "new": 4 * GiB}
    v = admit_device_load(custom(group=16 * GiB), held_by(workers, held), "big", 4 * GiB)
    # 16 + 4 = 20 > 18: stop "old" (6 GiB on the device) -> 14 + 4 = 18 <= 18
    assert v.admitted and v.evict == ["old"] and v.pool == "device"
    assert (v.usage, v.target, v.ceiling) == (16 * GiB, 18 * GiB, 20 * GiB)


def test_d5_a2_never_evicts_pinned_busy_loading_or_the_model_itself():
    workers = [w("pinned", pinned=True, last_access=0), w("busy", state="busy", running=1),
               w("queued", queued=1), w("loading", state="loading"), w("self", model="big"),
               w("idle", last_access=5)]
    held = {name.worker: 3 * GiB for name in workers}
    v = admit_device_load(custom(group=18 * GiB), held_by(workers, held), "big", 2 * GiB)
    assert v.evict == ["idle"] and v.admitted


def test_d5_a2_skips_idle_workers_that_hold_no_device_bytes():
    """Stopping a worker with nothing on the device frees nothing in this pool."""
    workers = [w("cpu", last_access=1), w("gpu", last_access=2)]
    v = admit_device_load(custom(group=16 * GiB), held_by(workers, {"gpu": 16 * GiB}), "big", 4 * GiB)
    assert v.evict == ["gpu"]


def test_d5_draining_device_bytes_count_as_gone_and_are_waited_for():
    workers = [w("leaving", state="draining"), w("idle", last_access=1)]
    held = {"leaving": 10 * GiB, "idle": 6 * GiB}
    v = admit_device_load(custom(group=16 * GiB), held_by(workers, held), "big", 10 * GiB)
    assert v.usage == 6 * GiB and v.wait_for == ["leaving"] and v.evict == []


def test_d5_a3_admits_above_the_target_when_under_the_device_ceiling():
    v = admit_device_load(custom(group=15 * GiB), held_by([w("busy", state="busy", running=1)], {"busy": 15 * GiB}), "m", 5 * GiB)
    assert v.admitted and v.evict == [] and v.error == ""


def test_d5_refuses_naming_device_pool():
    v = admit_device_load(custom(group=1 * GiB), held_by([w("idle")], {"idle": 1 * GiB}), "huge", 21 * GiB)
    assert not v.admitted and v.error == MODEL_TOO_LARGE and v.pool == "device"
    assert v.message.startswith("model too large for the device pool: huge needs 21 GiB")
    assert v.binding == "device_static" and "custom_device_ceiling" in v.remedy
    assert v.remedy in v.message
    assert v.evict == []  # a refused load destroys nothing


def test_d5_refuses_insufficient_device_memory_naming_device_others():
    c = custom(group=8 * GiB, others=4 * GiB)  # ceiling 20 - 4 = 16
    workers = [w("busy", state="busy", running=1), w("idle")]
    v = admit_device_load(c, held_by(workers, {"busy": 6 * GiB, "idle": 2 * GiB}), "m", 12 * GiB)
    assert not v.admitted and v.error == INSUFFICIENT_MEMORY and v.evict == []
    assert v.message.startswith("insufficient device memory: m needs 12 GiB")
    assert "10 GiB of the device_others device ceiling 16 GiB" in v.message  # 16 - 6 busy
    assert v.binding == "device_others" and "other processes on the GPU" in v.remedy


def test_d5_reserve_as_large_as_the_device_refuses_every_load():
    c = dev("safe", total=768 * MiB, group=0)
    v = admit_device_load(c, held_by([], {}), "tiny", 1 * MiB)
    assert not v.admitted and v.error == MODEL_TOO_LARGE
    assert "reserves 1 GiB of device memory" in v.message and "choose a tier" in v.remedy


def test_d5_a4_guard_off_evicts_toward_device_static_and_never_refuses():
    c = custom(group=18 * GiB, enabled=False)  # admission ceiling: static 20, target 18
    workers = [w("a", last_access=1), w("b", last_access=2)]
    held = {"a": 10 * GiB, "b": 8 * GiB}
    fits = admit_device_load(c, held_by(workers, held), "m", 12 * GiB)
    assert fits.admitted and fits.evict == ["a", "b"] and fits.ceiling == 20 * GiB
    over = admit_device_load(c, held_by(workers, held), "m", 25 * GiB)
    assert over.admitted and over.error == "" and "the guard is off" in over.message


def test_d5_error_codes_are_the_host_admissions():
    assert (MODEL_TOO_LARGE, INSUFFICIENT_MEMORY) == (admission.MODEL_TOO_LARGE, admission.INSUFFICIENT_MEMORY)


# -- C14 on the device -------------------------------------------------------------


def test_c14_device_tier_preview_shows_every_tier():
    p = device_tier_preview(TOTAL, 16 * GiB, 4 * GiB, custom_device_ceiling=20 * GiB)
    assert list(p) == list(TIERS)
    assert p["safe"].reserve_bytes == int(0.10 * TOTAL) and p["safe"].others_bytes == 4 * GiB
    assert p["aggressive"].ceiling_bytes == 16 * GiB + 4 * GiB - p["aggressive"].reserve_bytes
    assert p["aggressive"].binding == "device_others"
    assert p["custom"].static_bytes == 20 * GiB
    for tier in TIERS:
        c = dev(tier, group=4 * GiB, others=4 * GiB, **CUSTOM20)
        assert p[tier].soft_bytes == c.soft and p[tier].ceiling_bytes == c.ceiling


def test_c14_device_tier_preview_custom_unset_is_balanceds():
    p = device_tier_preview(TOTAL, 20 * GiB, 4 * GiB)
    assert p["custom"].reserve_bytes == p["balanced"].reserve_bytes


def test_c14_device_tier_preview_is_empty_without_a_device():
    assert device_tier_preview(0, None, 0) == {}


# -- [guard] custom_device_ceiling ---------------------------------------------------


def test_d2_config_custom_device_ceiling_is_a_size_carried_to_the_guard():
    c = parse_config('[guard]\ntier = "custom"\ncustom_device_ceiling = "20GiB"')
    assert c.guard.custom_device_ceiling == 20 * GiB
    assert guard_settings(c).custom_device_ceiling == 20 * GiB
    assert guard_settings(parse_config("")).custom_device_ceiling == 0


@pytest.mark.parametrize(
    "value, fragment",
    [
        ('"12 parsecs"', "guard.custom_device_ceiling: unknown unit"),
        ("-5", "guard.custom_device_ceiling: size must not be negative"),
        ('"1.5"', "guard.custom_device_ceiling: a byte count must be whole"),
        ("20", "guard.custom_device_ceiling: must be 0 (unset) or at least 1MiB, got 20 bytes"),
        ("true", "guard.custom_device_ceiling: "),
    ],
)
def test_d2_config_bad_custom_device_ceiling_names_the_key(value, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(f"[guard]\ncustom_device_ceiling = {value}", source="my.toml")
    assert str(info.value).startswith("my.toml: ") and fragment in str(info.value), str(info.value)


def test_d2_guard_settings_without_the_key_still_decode():
    """Replay traces written before the device pool had its custom ceiling lack the key."""
    g = msgspec.json.decode(b'{"tier": "custom", "custom_ceiling": 5}', type=GuardSettings)
    assert g.custom_device_ceiling == 0
