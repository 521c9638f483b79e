"""Before a pull: could these weights ever fit under this machine's ceiling?

A pull of a model that no load could ever admit (SPEC A3: "model too large")
wastes the download, so it is refused before the first weight byte, with the
reason and what would fit. "Ever" is the part of the ceiling that does not
move with other apps: the static ceiling (C1), the GPU cap (C8) and, on the
custom tier, the user's own ceiling (C3); with the guard off (C7, A4), the
static ceiling. A model that fits that but not today's admission ceiling
(the dynamic term, C2: other apps hold memory now) is pulled, with a note
saying what stands in the way of loading it now. On a discrete GPU (D5) the
weights count against the device pool instead.

The figures come from the running supervisor's status (S1) when one runs,
else from this machine's probes under a tier (C14, as `tiers` shows them).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.sizes import format_size
from shared.vocab import Tier
from supervisor.models.hub_repo import Plan, quant_of
from supervisor.policy.status import GuardStatus

PoolKind = Literal["host", "device"]


class Room(msgspec.Struct, frozen=True, kw_only=True):
    """What this machine gives a model: `ever` at most, `now` today."""

    ever: int        # the stable ceiling (0: no limit)
    now: int         # the admission ceiling in force (C7), dynamic term included
    pool: PoolKind
    tier: str
    source: str      # where the figures come from, in words
    remedy: str      # what a person can do to raise `ever`


_RAISE_STATIC = "a tier that keeps less in reserve (serve --tier aggressive)"


def room_from_status(g: GuardStatus) -> Room:
    """The running supervisor's figures (SPEC S1)."""
    source = f"the running supervisor (tier {g.tier}{'' if g.enabled else ', guard off'})"
    if g.device is not None:
        d = g.device
        return Room(ever=d.static, now=d.ceiling or d.static, pool="device",
                    tier=g.tier, source=source, remedy="a tier that reserves less of the device, or a smaller model")
    ever = g.residency_ceiling if g.enabled else g.static
    if g.enabled and g.tier == "custom" and g.custom_ceiling > 0:
        ever = min(ever, g.custom_ceiling)
    remedy = "raise the custom ceiling" if g.tier == "custom" else _RAISE_STATIC
    return Room(ever=ever or g.static, now=g.admission_ceiling or g.static, pool="host", tier=g.tier,
                source=source, remedy=remedy)


def room_from_machine(tier: Tier) -> Room:
    """This machine's probes under `tier`, when no supervisor runs (C14's preview)."""
    from shared import probe
    from supervisor.cli.probe import read_device_quietly
    from supervisor.policy.ceilings import tier_preview
    from supervisor.policy.device import device_tier_preview

    source = f"this machine under tier {tier}, no supervisor running"
    device, _why = read_device_quietly()
    if device is not None:
        d = device_tier_preview(device.total, device.free, 0, 0)[tier]
        return Room(ever=d.static_bytes, now=d.ceiling_bytes, pool="device", tier=tier, source=source,
                    remedy="a tier that reserves less of the device, or a smaller model")
    own = probe.own_footprint() or 0
    t = tier_preview(probe.read_host_counters(), own)[tier]
    ever = min(x for x in (t.static_bytes, t.gpu_cap_bytes) if x > 0) if t.static_bytes else 0
    return Room(ever=ever, now=t.ceiling_bytes, pool="host", tier=tier, source=source, remedy=_RAISE_STATIC)


def refusal(plan: Plan, room: Room) -> str | None:
    """Why the plan's model could never be loaded here (A3's "model too large"), with what would
    fit; None if it could."""
    model, weight_bytes = plan.ref.model_id, plan.weight_bytes
    if room.ever <= 0 or weight_bytes <= room.ever:
        return None
    pool = "device memory" if room.pool == "device" else "memory"
    words = (f"{model} needs about {format_size(weight_bytes)} of {pool} once loaded, more than the "
             f"{format_size(room.ever)} this machine can ever give one model ({room.source}); "
             f"to raise it: {room.remedy}")
    fitting = sorted((size, name) for name, size in plan.others if 0 < size <= room.ever)
    if fitting:
        size, name = fitting[-1]
        quant = quant_of(name)
        how = f"{plan.ref.repo}:{quant}" if quant else f"{plan.ref.repo} --file {name}"
        return f"{words}. {name} would fit (about {format_size(size)}): pull {how}"
    return f"{words}. Models up to {format_size(room.ever)} fit (a 4-bit version is about a quarter of float16's size)"


def note_now(model: str, weight_bytes: int, room: Room) -> str:
    """A pulled model that fits `ever` but not today's ceiling: what stands in the way now ("" if nothing)."""
    if room.now <= 0 or weight_bytes <= room.now:
        return ""
    return (f"note: {model} (about {format_size(weight_bytes)}) does not fit under today's ceiling of "
            f"{format_size(room.now)}: other apps hold memory now; close some before loading it")
