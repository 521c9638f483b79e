"""Supervisor -> anyone on PUB (first frame: the topic): `Published`."""

from __future__ import annotations

from typing import Union

import msgspec

from shared.messages.envelope import Msg
from shared.messages.reports import Sample
from shared.vocab import DeviceBinding, GuardEventKind, HostBinding, LoadPhase, PressureLevel, Tier

__all__ = [
    "TOPICS", "DevicePool", "CeilingMsg", "PressureMsg", "LoadReport", "GuardEvent", "StatusMsg", "Published",
    "TOPIC_OF"
]


TOPICS = ("ceiling", "pressure", "sample", "event", "status")


class DevicePool(msgspec.Struct, frozen=True, kw_only=True):
    """SPEC D6: a discrete device's pool (D2-D4), shown beside the host's.

    One struct for one fact, carried by `CeilingMsg.device`, `PressureMsg.device`
    and the status (`GuardStatus.device`). Those fields are None where there is
    no discrete device (unified memory, CPU only): every surface then shows the
    host pool alone, as before.
    """

    name: str = ""                # the device's name ("" when unknown)
    total: int                    # device memory
    free: Union[int, None]        # free on the device now; None: no reading (dynamic = static)
    usage: int                    # the group's device bytes (D1): the pool's usage
    others: int                   # held by other processes on the GPU (0 without a free reading)
    reserve: int                  # D2
    reserve_exceeds_total: bool   # static floored to 1 byte: every load is refused
    static: int                   # D3 device static
    dynamic: int                  # D3 device dynamic
    ceiling: int                  # D3; 0 = guard off (no limit)
    binding: DeviceBinding        # "" when the guard is off
    remedy: str                   # what a person can do about the binding ("" if none)
    soft_threshold: float
    hard_threshold: float
    soft_bytes: int               # C11 on the device
    hard_bytes: int
    level: PressureLevel          # D4: this pool's level
    emergency: bool               # P2 on the device
    utilization: float            # usage / ceiling, 0 when there is no ceiling


class CeilingMsg(Msg, tag="ceiling", kw_only=True):
    t: float
    enabled: bool
    tier: Tier
    ceiling: int
    static: int
    dynamic: int
    gpu_cap: int
    binding: HostBinding
    soft_bytes: int
    hard_bytes: int
    reserve: int
    hot_cache_max: int = 0       # H2: the group's prompt-cache budget (watch shows the sum against it)
    hot_cache_reserved: int = 0  # C12
    device: Union[DevicePool, None] = None  # D6: the discrete device's pool (None: no device)


class PressureMsg(Msg, tag="pressure", kw_only=True):
    t: float
    level: PressureLevel         # the group's: the worse of host and device (D4)
    usage: int
    soft_bytes: int
    hard_bytes: int
    ceiling: int
    utilization: float
    admission_paused: bool
    interval: float
    device: Union[DevicePool, None] = None  # D6: the device pool's usage and level (None: no device)


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """SPEC W3, W6: where one model's load stands, or what it cost once done.

    Carried by the `load_progress` events (the phase it is in, the weights read
    so far) and the `load_phases` event that closes a load (`phase` is then
    `first_token`, and `phases` holds every phase's seconds). `bytes_read` is
    what the worker has read of its weight files (0 where its platform cannot
    count its own reads); `estimate_bytes` is A2's estimate of them.
    """

    phase: LoadPhase
    bytes_read: int = 0
    estimate_bytes: int = 0
    elapsed: float = 0.0                 # seconds since the load began
    phases: dict[LoadPhase, float] = {}  # seconds each finished phase took, in LoadPhase's order
    spare: bool = False                  # the load took a spare worker (W1) instead of a fresh one


class GuardEvent(Msg, tag="event", kw_only=True):
    """SPEC S2: every level change, eviction, abort, reclaim, kill, respawn,
    refused load ... with the reason people read."""

    t: float
    kind: GuardEventKind
    reason: str
    worker_id: str = ""
    model_id: str = ""
    usage: int = 0
    ceiling: int = 0
    load: Union[LoadReport, None] = None  # W3, W6: on `load_progress` and `load_phases` events


class StatusMsg(Msg, tag="status", kw_only=True):
    t: float
    # SPEC S1 as JSON (supervisor.policy.status.ServerStatus; the struct lives with
    # the status builder, which this package must not import).
    status: bytes


Published = Union[CeilingMsg, PressureMsg, Sample, GuardEvent, StatusMsg]

TOPIC_OF = {CeilingMsg: "ceiling", PressureMsg: "pressure", Sample: "sample", GuardEvent: "event", StatusMsg: "status"}
