"""What each memory-guard tier means (SPEC T1-T5): its reserve, its share of
other apps' memory and its watermark fractions.

A tier says how much memory the guard leaves for the OS and other apps. Each
number here was paid for by an incident in the in-process predecessor: too
small a reserve on `aggressive` jetsammed the server during model loads,
thresholds that ignored the tier made `safe` evict at the same point as
`aggressive`. Pure functions only; nothing here reads the machine.

Public names (stable): TierParams, TIER_PARAMS, normalise_tier, clamp,
reserve_bytes, other_app_ratio, resolve_thresholds, check_thresholds,
ThresholdError, LEGACY_SOFT, LEGACY_HARD.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from shared.sizes import GiB
from shared.vocab import TIERS, Tier, parse

DEFAULT_TIER: Tier = "balanced"

# T5: a saved 0.85 / 0.95 is the old global default, not a user's choice.
LEGACY_SOFT = 0.85
LEGACY_HARD = 0.95
_LEGACY_EPS = 1e-9

CUSTOM_RESERVE = 2 * GiB


class TierParams(NamedTuple):
    """T1 reserve clamp, T3 ratio and T4 fractions of one tier."""

    share: float          # of total; custom uses a fixed reserve instead
    reserve_min: int
    reserve_max: int
    other_app_ratio: float
    soft: float
    hard: float
    headroom_safety: float  # G2 prefill headroom safety
    abort_margin: float     # G1/G2 prefill abort margin


TIER_PARAMS: dict[Tier, TierParams] = {
    "safe": TierParams(0.20, 6 * GiB, 16 * GiB, 0.0, 0.85, 0.95, 0.90, 0.90),
    "balanced": TierParams(0.08, 3 * GiB, 8 * GiB, 0.0, 0.90, 0.95, 0.92, 0.93),
    "aggressive": TierParams(0.02, int(1.5 * GiB), 4 * GiB, 0.5, 0.95, 0.98, 0.97, 0.97),
    "custom": TierParams(0.0, CUSTOM_RESERVE, CUSTOM_RESERVE, 0.0, 0.90, 0.97, 0.95, 0.95),
}


def normalise_tier(name: str | None) -> tuple[Tier, bool]:
    """T2: (tier, known). Strip and lower-case; unknown or empty -> balanced.

    Called where a name enters, never inside a tick: the config and
    `POST /admin/guard` refuse a name that is not `known` (a bad value is a
    configuration error with its key), and a replayed trace guards with
    balanced and says so once (supervisor.policy.replay).
    """
    tier = parse((name or "").strip().lower(), TIERS)
    return (DEFAULT_TIER, False) if tier is None else (tier, True)


def clamp(x: float, lo: int, hi: int) -> int:
    """T1: `int(min(hi, max(lo, x)))` (also D2's device reserve)."""
    return int(min(hi, max(lo, x)))


def reserve_bytes(tier: Tier, total: int) -> int:
    """T1: memory `tier` leaves for the OS and other apps on a `total`-byte machine."""
    params = TIER_PARAMS[tier]
    if tier == "custom":
        return CUSTOM_RESERVE
    return clamp(total * params.share, params.reserve_min, params.reserve_max)


def other_app_ratio(tier: Tier, compressor: bool) -> float:
    """T3: share of other apps' anonymous active memory the OS can take back.

    Without a compressor or swap (Linux with no swap/zram/zswap) that memory
    cannot be handed over at all, so counting it would promise memory that is
    not there and the OOM killer would collect the difference.
    """
    return TIER_PARAMS[tier].other_app_ratio if compressor else 0.0


def _override(value: float | None, legacy: float) -> float | None:
    if value is None or value <= 0 or abs(value - legacy) < _LEGACY_EPS:
        return None
    return float(value)


def resolve_thresholds(tier: Tier, soft: float | None, hard: float | None) -> tuple[float, float]:
    """T5: the (soft, hard) fractions in force for `tier` (already normalised).

    An explicit value wins unless absent, <= 0 or the legacy default, so a
    config saved by an older version does not pin every tier to 0.85/0.95.
    Never raises; `check_thresholds` is the validating door.
    """
    params = TIER_PARAMS[tier]
    soft_override = _override(soft, LEGACY_SOFT)
    hard_override = _override(hard, LEGACY_HARD)
    return (
        params.soft if soft_override is None else soft_override,
        params.hard if hard_override is None else hard_override,
    )


class ThresholdError(ValueError):
    """T5 configuration error; `key` is the threshold at fault."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def check_thresholds(tier: Tier, soft: float | None, hard: float | None) -> tuple[float, float]:
    """T5: validate explicit thresholds against `tier` and return the fractions in force.

    Raises `ThresholdError` when a threshold is not a number, is above 1, or
    when the soft fraction in force is not below the hard one (the guard would
    jump from ok straight to hard and never pause admission first). The check
    uses the thresholds in force for this tier: an explicit soft 0.96 is fine
    on `aggressive` (hard 0.98) and an error on `balanced` (hard 0.95).
    """
    for key, value in (("soft_threshold", soft), ("hard_threshold", hard)):
        if value is not None and not math.isfinite(value):
            raise ThresholdError(key, f"must be a number, got {value!r}")
        if value is not None and value > 1:
            raise ThresholdError(key, f"must be at most 1 (a fraction of the ceiling), got {value}")
    soft_in_force, hard_in_force = resolve_thresholds(tier, soft, hard)
    if soft_in_force >= hard_in_force:
        raise ThresholdError(
            "soft_threshold",
            f"soft {soft_in_force} must be below hard {hard_in_force} "
            f"(thresholds in force for tier {tier!r})",
        )
    return soft_in_force, hard_in_force
