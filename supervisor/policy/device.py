"""The discrete device pool (SPEC D2-D5): reserve, ceiling, level, admission.

On a discrete GPU (CUDA) device memory is a second pool beside host RAM. The
host rules (T, C, P, A) stay as they are; this module gives the device pool
rules of the same shape, as pure functions of numbers the caller read (D1:
NVML, or `mx.device_info()` and MLX active + pool per worker). Nothing here
reads a clock, a file, NVML or MLX.

No device. `compute_device_ceilings` returns **None** when the device total
is 0 (unified memory, CPU only, or no reading): there is no device pool to
guard. Every other function here takes `DeviceCeilings | None` and reads None
as "no device": level ok, no emergency, every load admitted, an empty tier
preview. So the tick can call them unconditionally.

Inputs per tick (D1):

- `total`, `free`: the device's memory and what is free on it now. `free`
  None means "no free reading": the dynamic term falls back to static, as C2
  does without host counters. `free` 0 is a real reading (the device is full).
- `group_bytes`: the device bytes the guarded group holds (sum of the
  workers' device bytes; `WorkerGroup.device_bytes`). The supervisor
  holds none: it never imports MLX.
- per worker: `WorkerRecord.device_bytes` (NVML per-process used memory,
  else MLX active + pool), filled in by the enforcer.

The rules:

- D2 `device_reserve`: safe clamp(0.10 x total, 1 GiB, 8 GiB), balanced
  clamp(0.05 x, 512 MiB, 4 GiB), aggressive clamp(0.02 x, 256 MiB, 2 GiB).
  custom with `[guard] custom_device_ceiling` set: reserve = max(0, total -
  custom_device_ceiling), so device static *is* the custom value (capped at
  the device); custom unset: balanced's reserve.
- D3 `compute_device_ceilings`: static = total - reserve (floored to 1 byte
  when the reserve takes the whole device: every load is refused, never "no
  limit"); dynamic = free + group_bytes - reserve, floored to 1; ceiling =
  min(static, dynamic); binding "device_static" or "device_others" (other
  processes on the GPU hold what is missing), first equal in that order.
  The dynamic term applies on every tier, custom included: device memory held
  by another process cannot be compressed or swapped away. Guard off: ceiling
  0 ("no limit", as C5), binding "", watermarks 0; admission still uses static
  (C7). Watermarks: soft/hard = T4/T5 thresholds of the tier x ceiling (C11).
- D4 `device_level` (P1), `device_emergency` (P2: returns the new
  over-ceiling count for the tick to store, mutates nothing), `worse_level`
  (the group's level is the worse of the two pools).
- D5 `admit_device_load`: A1-A4 on device bytes, victims ordered as
  admission.py orders them (idle, non-pinned, not the model being loaded,
  least recently used first by `group.lru_key`), skipping workers that hold no
  device bytes (stopping them frees nothing in this pool). It answers for the
  device pool only; the host half of the load (what it holds in RAM) still
  goes through `admission.admit_load`, and a load is admitted when both are
  (evict the union, wait for the union).
- C14's shape for the device: `device_tier_preview`.

Public names (stable): DeviceReserveParams, DEVICE_RESERVE_PARAMS,
DEVICE_BINDINGS, DEVICE_EMERGENCY_MARGIN, DEVICE_EMERGENCY_TICKS,
MODEL_TOO_LARGE, INSUFFICIENT_MEMORY, device_reserve, DeviceCeilings,
compute_device_ceilings, device_remedy, device_reserve_message,
device_level, DeviceEmergency, device_emergency,
worse_level, admit_device_load, DeviceTierPreview,
device_tier_preview.
"""

from __future__ import annotations

from typing import NamedTuple, get_args

import msgspec

from shared.sizes import GiB, MiB, format_size
from shared.vocab import DeviceBinding, PressureLevel, RefusalCode, Tier
from supervisor.policy.group import (
    EMERGENCY_MARGIN,
    EMERGENCY_TICKS,
    WorkerGroup,
    classify,
    is_idle,
    lru_key,
    over_ceiling,
)
from supervisor.policy.pools import first_binding, pool_marks, previews, remedy, reserve_message
from supervisor.policy.snapshot import Snapshot, WorkerRecord
from supervisor.policy.tiers import clamp, resolve_thresholds
from supervisor.policy.verdict import DEVICE_TERMS, INSUFFICIENT_MEMORY, MODEL_TOO_LARGE, LoadVerdict, decide_load

__all__ = [
    "DEVICE_BINDINGS",
    "DEVICE_EMERGENCY_MARGIN",
    "DEVICE_EMERGENCY_TICKS",
    "DEVICE_RESERVE_PARAMS",
    "INSUFFICIENT_MEMORY",
    "MODEL_TOO_LARGE",
    "DeviceCeilings",
    "DeviceEmergency",
    "DeviceReserveParams",
    "DeviceTierPreview",
    "admit_device_load",
    "compute_device_ceilings",
    "device_emergency",
    "device_level",
    "device_remedy",
    "device_reserve",
    "device_reserve_message",
    "device_tier_preview",
    "device_ceilings_for",
    "worse_level",
]

# P2's numbers: the device pool counts as the host's does (group.over_ceiling).
DEVICE_EMERGENCY_MARGIN = EMERGENCY_MARGIN
DEVICE_EMERGENCY_TICKS = EMERGENCY_TICKS

DEVICE_BINDINGS: tuple[DeviceBinding, ...] = get_args(DeviceBinding)


class DeviceReserveParams(NamedTuple):
    """D2: the reserve is clamp(share x device total, reserve_min, reserve_max)."""

    share: float
    reserve_min: int
    reserve_max: int


DEVICE_RESERVE_PARAMS: dict[Tier, DeviceReserveParams] = {
    "safe": DeviceReserveParams(0.10, 1 * GiB, 8 * GiB),
    "balanced": DeviceReserveParams(0.05, 512 * MiB, 4 * GiB),
    "aggressive": DeviceReserveParams(0.02, 256 * MiB, 2 * GiB),
}


def device_reserve(tier: Tier, device_total: int, custom_device_ceiling: int = 0) -> int:
    """D2: device memory `tier` leaves free on a `device_total`-byte device.

    On `custom` a set
    `custom_device_ceiling` is the device static ceiling, so the reserve is
    what the device has beyond it, floored at 0 (a custom value above the
    device caps at the device); unset (0) falls back to balanced's reserve.
    `custom_device_ceiling` is ignored on the other tiers.
    """
    name = tier
    total = max(0, device_total)
    if name == "custom":
        if custom_device_ceiling > 0:
            return max(0, total - custom_device_ceiling)
        name = "balanced"
    params = DEVICE_RESERVE_PARAMS[name]
    return clamp(total * params.share, params.reserve_min, params.reserve_max)


class DeviceCeilings(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Every device-pool number of one tick (D3), beside the host's `Ceilings`.

    `ceiling` 0 means the guard is off (as C5); with the guard on it is at
    least 1 byte. `others` is what other processes (and the driver) hold:
    total - free - group_bytes, 0 without a free reading.
    """

    enabled: bool
    tier: Tier
    total: int
    free: int                    # 0 when unknown (see free_known)
    free_known: bool             # False: no free reading, dynamic = static
    group_bytes: int             # the group's device bytes
    others: int
    reserve: int                 # D2
    reserve_exceeds_total: bool  # static had to be floored to 1 byte
    static: int                  # D3 device static
    dynamic: int                 # D3 device dynamic
    ceiling: int                 # D3; 0 = guard off
    binding: DeviceBinding       # "" when the guard is off
    admission_ceiling: int       # C7 on the device: ceiling, or static with the guard off
    admission_binding: DeviceBinding
    admission_soft_target: int   # C9 on the device
    soft_threshold: float        # T4/T5 in force for the tier
    hard_threshold: float
    soft: int                    # C11 on the device
    hard: int


def compute_device_ceilings(
    *,
    tier: Tier,
    total: int,
    free: int | None,
    group_bytes: int,
    enabled: bool = True,
    custom_device_ceiling: int = 0,
    soft_threshold: float | None = None,
    hard_threshold: float | None = None,
) -> DeviceCeilings | None:
    """D2-D3 for one tick; None when there is no device (`total` <= 0).

    `soft_threshold`/`hard_threshold` are the guard's raw overrides
    (GuardSettings), resolved per T5 as for the host.
    """
    if total <= 0:
        return None
    reserve = device_reserve(tier, total, custom_device_ceiling)
    static = total - reserve
    exceeds = static <= 0
    if exceeds:
        static = 1  # never 0, which would read as "no limit"
    group = max(0, group_bytes)
    if free is None:
        free_now, others, dynamic = 0, 0, static
    else:
        free_now = max(0, free)
        others = max(0, total - free_now - group)
        dynamic = max(1, free_now + group - reserve)
    soft_t, hard_t = resolve_thresholds(tier, soft_threshold, hard_threshold)
    ceiling, admission_ceiling, soft_target, soft, hard = pool_marks(
        enabled, min(static, dynamic), static, soft_t, hard_t)
    binding: DeviceBinding = first_binding(ceiling, (("device_static", static), ("device_others", dynamic)), "")
    return DeviceCeilings(
        enabled=enabled,
        tier=tier,
        total=total,
        free=free_now,
        free_known=free is not None,
        group_bytes=group,
        others=others,
        reserve=reserve,
        reserve_exceeds_total=exceeds,
        static=static,
        dynamic=dynamic,
        ceiling=ceiling,
        binding=binding,
        admission_ceiling=admission_ceiling,
        admission_binding=binding if enabled else "device_static",
        admission_soft_target=soft_target,
        soft_threshold=soft_t,
        hard_threshold=hard_t,
        soft=soft,
        hard=hard,
    )


device_remedy = remedy
"""D3: what a person can do about the device constraint that binds (pools.remedy: one table for both
pools; on the custom tier device static is the user's `custom_device_ceiling`, D2, so it says to raise it)."""


def device_reserve_message(c: DeviceCeilings | None) -> str:
    """C1 on the device: the words for a reserve that takes the whole device ("" otherwise)."""
    if c is None:
        return ""
    return reserve_message("device", c.tier, c.reserve, c.total, c.reserve_exceeds_total)


def _held(w: WorkerRecord) -> int:
    return max(0, w.device_bytes)


def device_level(usage: int, c: DeviceCeilings | None) -> PressureLevel:
    """P1 on the device: ok below soft, soft below hard, else hard.

    No device or the guard off (ceiling 0): always ok.
    """
    return "ok" if c is None else classify(usage, c.ceiling, c.soft, c.hard)


class DeviceEmergency(NamedTuple):
    """P2 on the device: the count to carry to the next tick, and the verdict."""

    over_ceiling_ticks: int
    emergency: bool


def device_emergency(
    usage: int, c: DeviceCeilings | None, over_ceiling_ticks: int, *, recheck: bool = False
) -> DeviceEmergency:
    """P2 on the device, as pressure.py's tick does it for the host.

    `over_ceiling_ticks` is the count the previous tick returned. Below the
    ceiling (or no device, or guard off) the count resets to 0. At or over it
    the count goes up by one, except on a `recheck` (P7: the re-evaluation
    right after acting is not a new tick: it may reset the count, never
    advance it). Emergency when usage >= ceiling + 2 GiB or the count reaches 2.
    """
    if c is None:
        return DeviceEmergency(0, False)
    return DeviceEmergency(*over_ceiling(usage, c.ceiling, over_ceiling_ticks, recheck))


_LEVEL_RANK: dict[PressureLevel, int] = {"ok": 0, "soft": 1, "hard": 2}


def worse_level(a: PressureLevel, b: PressureLevel) -> PressureLevel:
    """D4: the group's level is the worse of the host's and the device's."""
    return a if _LEVEL_RANK[a] >= _LEVEL_RANK[b] else b


def admit_device_load(
    c: DeviceCeilings | None,
    g: WorkerGroup,
    model_id: str,
    size_bytes: int,
) -> LoadVerdict:
    """D5: A1-A4 on device bytes for loading `model_id` (`size_bytes` on the device).

    `g` is the tick's group, each worker with its device bytes (D1). Usage is
    projected as admission.py does it: the group's device bytes less those of
    workers already draining (listed in `wait_for`). A1: evict target = min(device admission soft target,
    device admission ceiling). A2: while usage + size > target, stop the least
    recently used idle non-pinned worker that holds device bytes (never one
    serving `model_id`), counting the device bytes it holds as freed. A3:
    admit when usage + size <= the device admission ceiling, else refuse
    (evicting nothing) naming the device pool, the binding and its remedy.
    A4: guard off, the admission ceiling is device static and nothing is
    refused. No device (`c` None): admitted, nothing to evict.
    """
    size = max(0, size_bytes)
    draining = [w for w in g.live if w.state == "draining"]
    usage = g.device_bytes - g.draining_device_bytes
    if c is None:
        return LoadVerdict(pool="device", admitted=True, usage=usage, size=size,
                           message=f"load {model_id}: no discrete device, nothing to guard")
    ceiling = c.admission_ceiling
    target = min(c.admission_soft_target, ceiling)  # A1
    victims = sorted(
        (w for w in g.live
         if is_idle(w) and not w.pinned and w.model != model_id and _held(w) > 0),
        key=lru_key,
    )

    def refuse(after: int) -> tuple[RefusalCode, str, str]:
        error, text = _refusal(model_id, c, size, after)
        return error, text, device_remedy("device_static" if c.reserve_exceeds_total else c.admission_binding, c.tier)

    return decide_load(
        DEVICE_TERMS, model_id, size=size, usage=usage, ceiling=ceiling, target=target,
        binding=c.admission_binding, enabled=c.enabled, victims=((w.worker, _held(w)) for w in victims),
        wait_for=[w.worker for w in draining], refuse=refuse)


def _refusal(model_id: str, c: DeviceCeilings, size: int, after: int) -> tuple[RefusalCode, str]:
    """A3 on the device: (error code, words naming the device pool and the binding)."""
    ceiling, binding = c.admission_ceiling, c.admission_binding
    if c.reserve_exceeds_total:
        return MODEL_TOO_LARGE, f"model too large for the device pool: {device_reserve_message(c)}"
    if size > ceiling:
        return MODEL_TOO_LARGE, (
            f"model too large for the device pool: {model_id} needs {format_size(size)} of "
            f"device memory, more than the whole {binding} device ceiling of {format_size(ceiling)}")
    return INSUFFICIENT_MEMORY, (
        f"insufficient device memory: {model_id} needs {format_size(size)} of device memory but "
        f"only {format_size(max(0, ceiling - after))} of the {binding} device ceiling "
        f"{format_size(ceiling)} is free after stopping every idle model")


class DeviceTierPreview(msgspec.Struct, frozen=True, kw_only=True):
    """C14 on the device: one tier's device ceiling right now (TierPreview's naming)."""

    reserve_bytes: int
    free_bytes: int
    others_bytes: int
    static_bytes: int
    dynamic_bytes: int
    ceiling_bytes: int
    binding: DeviceBinding
    soft_bytes: int
    hard_bytes: int


def device_tier_preview(
    device_total: int,
    device_free: int | None,
    group_bytes: int,
    custom_device_ceiling: int = 0,
    soft_threshold: float | None = None,
    hard_threshold: float | None = None,
) -> dict[str, DeviceTierPreview]:
    """C14 for the device pool: every tier's device ceiling on these readings.

    Empty when there is no device (`device_total` 0), so `tiers` shows the
    host pool alone. Thresholds follow T5 per tier, as for the host preview.
    """
    def ceilings(tier: Tier) -> DeviceCeilings | None:
        return compute_device_ceilings(tier=tier, total=device_total, free=device_free, group_bytes=group_bytes,
                                       custom_device_ceiling=custom_device_ceiling, soft_threshold=soft_threshold,
                                       hard_threshold=hard_threshold)

    def line(c: DeviceCeilings) -> DeviceTierPreview:
        return DeviceTierPreview(reserve_bytes=c.reserve, free_bytes=c.free, others_bytes=c.others,
                                 static_bytes=c.static, dynamic_bytes=c.dynamic, ceiling_bytes=c.ceiling,
                                 binding=c.binding, soft_bytes=c.soft, hard_bytes=c.hard)

    return previews(ceilings, line)


def device_ceilings_for(s: Snapshot, g: WorkerGroup) -> DeviceCeilings | None:
    """D3 for this snapshot (None: no discrete device)."""
    guard = s.guard
    return compute_device_ceilings(
        tier=guard.tier, total=s.device_total, free=s.device_free, group_bytes=g.device_bytes,
        enabled=guard.enabled, custom_device_ceiling=guard.custom_device_ceiling,
        soft_threshold=guard.soft_threshold, hard_threshold=guard.hard_threshold,
    )
