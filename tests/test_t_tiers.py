"""SPEC T1-T5 (what each tier means) and the `tiers` command (C14 contract)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.sizes import GiB
from supervisor.cli import main
from supervisor.config import guard_settings
from supervisor.config_file import parse_config
from supervisor.policy.decisions import Warn
from supervisor.policy.replay import ReplayTick, replay_lines
from supervisor.policy.tiers import (
    TIER_PARAMS,
    ThresholdError,
    check_thresholds,
    normalise_tier,
    other_app_ratio,
    reserve_bytes,
    resolve_thresholds,
)


@pytest.mark.parametrize(
    "tier, total, expected",
    [
        ("safe", 16 * GiB, 6 * GiB),            # 20% = 3.2 GiB, clamped up to 6
        ("safe", 48 * GiB, int(0.2 * 48 * GiB)),  # inside the clamp
        ("safe", 128 * GiB, 16 * GiB),          # clamped down to 16
        ("balanced", 16 * GiB, 3 * GiB),
        ("balanced", 64 * GiB, int(0.08 * 64 * GiB)),
        ("balanced", 512 * GiB, 8 * GiB),
        ("aggressive", 16 * GiB, int(1.5 * GiB)),
        ("aggressive", 100 * GiB, int(0.02 * 100 * GiB)),
        ("aggressive", 512 * GiB, 4 * GiB),
        ("custom", 16 * GiB, 2 * GiB),
        ("custom", 512 * GiB, 2 * GiB),
        ("safe", 0, 6 * GiB),
    ],
)
def test_t1_reserve_is_clamped_share_of_total(tier, total, expected):
    assert reserve_bytes(tier, total) == expected


def test_t1_reserve_truncates_toward_zero():
    total = 50 * GiB + 7  # 8% is fractional
    assert reserve_bytes("balanced", total) == int(total * 0.08)


@pytest.mark.parametrize(
    "name, tier, known",
    [
        ("safe", "safe", True),
        ("  Aggressive ", "aggressive", True),
        ("CUSTOM", "custom", True),
        ("", "balanced", False),
        (None, "balanced", False),
        ("turbo", "balanced", False),
    ],
)
def test_t2_tier_names_are_normalised_unknown_becomes_balanced(name, tier, known):
    assert normalise_tier(name) == (tier, known)


TRACE = Path(__file__).parent / "fixtures" / "traces" / "pressure_episode.jsonl"


def _trace(*tiers: str, tier_warned: bool = False) -> list[bytes]:
    """The episode's first line once per tier name, as a trace (recorded before T2 moved to the
    edge when `tier_warned`: such traces carry it in their state)."""
    first = json.loads(TRACE.read_bytes().splitlines()[0])
    lines = []
    for tier in tiers:
        first["guard"]["tier"] = tier
        if tier_warned:
            first["state"]["tier_warned"] = ""
        lines.append(json.dumps(first).encode())
    return lines


def _t2_warnings(*tiers: str) -> list[list[str]]:
    return [[x.message for x in t.decisions if isinstance(x, Warn) and x.reason == "T2"]
            for t in replay_lines(_trace(*tiers))]


def test_t2_a_trace_with_an_unknown_tier_guards_with_balanced_and_says_so_once():
    """A trace is where a tier name enters the policy without a config's refusal: the tick
    reads only tiers (GuardSettings.tier is a Tier), so the name is normalised there, once."""
    assert _t2_warnings("Turbo") == [["unknown memory guard tier 'Turbo'; using 'balanced' "
                                      "(choose safe, balanced, aggressive or custom)"]]
    assert _t2_warnings("Turbo", "Turbo") == [[_t2_warnings("Turbo")[0][0]], []]
    assert [bool(w) for w in _t2_warnings("Turbo", "nitro")] == [True, True]
    assert [bool(w) for w in _t2_warnings("Turbo", "")] == [True, True]
    assert [bool(w) for w in _t2_warnings("Turbo", "balanced", "balanced")] == [True, False, False]
    balanced, turbo, safe, spaced = replay_lines(_trace("balanced", "Turbo", "safe", " Safe "), chained=False)
    assert isinstance(turbo, ReplayTick) and turbo.ceiling == balanced.ceiling != safe.ceiling  # type: ignore[union-attr]
    assert spaced.ceiling == safe.ceiling and not _t2_warnings(" Safe ")[0]  # type: ignore[union-attr]


def test_t2_a_trace_recorded_with_the_tick_s_tier_report_still_replays():
    (old,) = replay_lines(_trace("Turbo", tier_warned=True))
    assert isinstance(old, ReplayTick) and "T2" in [x.reason for x in old.decisions if isinstance(x, Warn)]


def test_t2_the_config_hands_the_guard_a_normalised_tier():
    assert guard_settings(parse_config('[guard]\ntier = " Safe "')).tier == "safe"


@pytest.mark.parametrize(
    "tier, compressor, ratio",
    [
        ("safe", True, 0.0),
        ("balanced", True, 0.0),
        ("aggressive", True, 0.5),
        ("custom", True, 0.0),
        ("aggressive", False, 0.0),
    ],
)
def test_t3_other_app_ratio_is_zero_without_a_compressor(tier, compressor, ratio):
    """Without swap/zram/zswap other apps' anonymous memory cannot be handed
    over; counting half of it on Linux would promise memory the OOM killer then
    takes back from the models."""
    assert other_app_ratio(tier, compressor) == ratio


@pytest.mark.parametrize(
    "tier, row",
    [
        ("safe", (0.85, 0.95, 0.90, 0.90)),
        ("balanced", (0.90, 0.95, 0.92, 0.93)),
        ("aggressive", (0.95, 0.98, 0.97, 0.97)),
        ("custom", (0.90, 0.97, 0.95, 0.95)),
    ],
)
def test_t4_watermark_defaults(tier, row):
    p = TIER_PARAMS[tier]
    assert (p.soft, p.hard, p.headroom_safety, p.abort_margin) == row
    assert resolve_thresholds(tier, None, None) == row[:2]


@pytest.mark.parametrize(
    "tier, soft, hard, expected",
    [
        ("aggressive", 0.85, 0.95, (0.95, 0.98)),      # legacy defaults -> tier defaults
        ("aggressive", 0.85 + 1e-12, 0.95 - 1e-12, (0.95, 0.98)),
        ("balanced", 0.0, -1.0, (0.90, 0.95)),         # <= 0 -> tier default
        ("balanced", 0.8, 0.9, (0.8, 0.9)),            # explicit wins
        ("safe", 0.7, None, (0.7, 0.95)),
        ("custom", None, 0.99, (0.90, 0.99)),
        ("balanced", 0.851, None, (0.851, 0.95)),      # not within 1e-9 of legacy
    ],
)
def test_t5_explicit_thresholds_win_except_legacy_and_non_positive(tier, soft, hard, expected):
    """A config saved by the old version carries 0.85/0.95; taking those
    literally pinned every tier to the same watermarks and made `aggressive`
    evict as early as `safe`."""
    assert resolve_thresholds(tier, soft, hard) == pytest.approx(expected)


@pytest.mark.parametrize(
    "tier, soft, hard, key, fragment",
    [
        ("balanced", 0.96, None, "soft_threshold", "below hard 0.95"),
        ("balanced", 0.9, 0.9, "soft_threshold", "below hard"),
        ("balanced", 1.2, None, "soft_threshold", "at most 1"),
        ("balanced", None, 1.01, "hard_threshold", "at most 1"),
        ("balanced", float("nan"), None, "soft_threshold", "must be a number"),
        ("balanced", 0.85, 0.8, "soft_threshold", "soft 0.9 must be below hard 0.8"),
    ],
)
def test_t5_bad_thresholds_are_errors_naming_key_and_reason(tier, soft, hard, key, fragment):
    with pytest.raises(ThresholdError) as info:
        check_thresholds(tier, soft, hard)
    assert info.value.key == key
    assert fragment in info.value.reason


def test_t5_soft_above_one_tier_hard_is_fine_on_a_tier_with_higher_hard():
    assert check_thresholds("aggressive", 0.96, None) == (0.96, 0.98)


# --- the `tiers` command (docs/operations.md, C14) ---------------------------

FIELDS = {
    "reserve_bytes", "free_bytes", "inactive_bytes", "other_apps_bytes", "static_bytes",
    "dynamic_bytes", "gpu_cap_bytes", "ceiling_bytes", "binding", "soft_bytes", "hard_bytes",
}


def _json(capsys, *argv: str) -> dict:
    assert main(["tiers", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_c14_tiers_json_has_exactly_the_contract_fields(capsys):
    out = _json(capsys, "--total", "24GiB", "--free", "6GiB", "--inactive", "3GiB",
                "--active", "8GiB", "--own", "4GiB")
    assert set(out) == {"tiers"}
    assert list(out["tiers"]) == ["safe", "balanced", "aggressive", "custom"]
    for preview in out["tiers"].values():
        assert set(preview) == FIELDS
    bal = out["tiers"]["balanced"]
    # dynamic = own + free + inactive - reserve = 4 + 6 + 3 - 3 GiB
    assert bal["dynamic_bytes"] == 10 * GiB
    assert bal["ceiling_bytes"] == 10 * GiB and bal["binding"] == "dynamic"
    assert out["tiers"]["aggressive"]["other_apps_bytes"] == 2 * GiB  # (8 - 4) * 0.5


def test_c14_tiers_what_if_counters_not_given_are_absent(capsys):
    """Only --total given: no counter at all, so dynamic falls back to static (C2)."""
    out = _json(capsys, "--total", "16GiB")
    bal = out["tiers"]["balanced"]
    assert bal["free_bytes"] == 0
    assert bal["dynamic_bytes"] == bal["static_bytes"] == 13 * GiB


def test_c14_tiers_what_if_available_only_and_compressor_off(capsys):
    out = _json(capsys, "--total", "16GiB", "--available", "5GiB", "--active", "8GiB",
                "--compressor", "off")
    agg = out["tiers"]["aggressive"]
    assert agg["free_bytes"] == 5 * GiB and agg["other_apps_bytes"] == 0
    assert agg["dynamic_bytes"] == 5 * GiB - int(1.5 * GiB)


def test_c14_tiers_custom_and_gpu_cap(capsys):
    out = _json(capsys, "--total", "64GiB", "--free", "40GiB", "--custom-ceiling", "20GiB",
                "--gpu-cap", "30GiB", "--own", "10GiB", "--own-gpu", "8GiB")
    custom = out["tiers"]["custom"]
    assert custom["free_bytes"] == custom["inactive_bytes"] == custom["other_apps_bytes"] == 0
    assert custom["dynamic_bytes"] == 20 * GiB and custom["binding"] == "dynamic"
    assert custom["gpu_cap_bytes"] == 32 * GiB  # raw + (own - own_gpu)


def test_c1_tiers_reserve_larger_than_machine_shows_static_one_byte(capsys):
    out = _json(capsys, "--total", "4GiB")
    assert out["tiers"]["safe"]["static_bytes"] == 1
    assert out["tiers"]["safe"]["ceiling_bytes"] == 1


def test_tiers_table_for_people_shows_gib_and_every_tier(capsys):
    assert main(["tiers", "--total", "4GiB", "--free", "1GiB"]) == 0
    text = capsys.readouterr().out
    for tier in ("safe", "balanced", "aggressive", "custom"):
        assert f"\n{tier} " in text
    assert "GiB" in text
    assert "safe reserves more than the machine has" in text


def test_tiers_bad_size_is_a_clear_error_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tiers", "--total", "4 parsecs"])
    assert info.value.code == 2
    assert "unknown unit" in capsys.readouterr().err


def test_tiers_without_flags_reads_this_machine(capsys):
    out = _json(capsys)
    bal = out["tiers"]["balanced"]
    assert bal["static_bytes"] > 0 and bal["ceiling_bytes"] > 0
    assert bal["binding"] in ("static", "dynamic", "gpu_cap")


def test_tiers_any_what_if_flag_reads_nothing_from_the_machine(monkeypatch, capsys):
    import supervisor.cli.tiers as cli

    def boom():
        raise AssertionError("the machine was read")

    monkeypatch.setattr(cli, "read_machine", boom)
    out = _json(capsys, "--compressor", "off")
    assert out["tiers"]["safe"]["reserve_bytes"] == 6 * GiB  # total 0: sizes not given are 0
    assert out["tiers"]["safe"]["static_bytes"] == 1
