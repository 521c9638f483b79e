"""CLI -> supervisor on the control socket: `ControlRequest`, answered by `ControlReply`."""

from __future__ import annotations

from typing import Union

from shared.messages.envelope import Msg
from shared.vocab import ErrorCode

__all__ = [
    "StatusRequest", "LoadRequest", "UnloadRequest", "DrillRequest", "GuardUpdate", "ReloadRequest",
    "ControlRequest", "ControlOk", "ControlError", "ControlReply"
]


class StatusRequest(Msg, tag="status_request", kw_only=True):
    pass


class LoadRequest(Msg, tag="load_request", kw_only=True):
    model: str
    # "Will it fit?": answer with a FitReport (JSON in ControlOk.data), spawn nothing.
    dry_run: bool = False
    context: int = 0  # tokens of KV cache to count on top of the weights (dry run)


class UnloadRequest(Msg, tag="unload_request", kw_only=True):
    model: str


class DrillRequest(Msg, tag="drill_request", kw_only=True):
    model: str
    rate: int
    to: int
    stop: bool = False


class GuardUpdate(Msg, tag="guard_update", kw_only=True):
    """SPEC T6: change tier, custom ceiling(s) or the on/off switch at runtime."""

    tier: Union[str, None] = None
    custom_ceiling: Union[int, None] = None
    enabled: Union[bool, None] = None
    custom_device_ceiling: Union[int, None] = None  # D2: the device ceiling on the custom tier (0 = unset)


class ReloadRequest(Msg, tag="reload_request", kw_only=True):
    """Re-read the config and rescan the models folders; running models stay up."""


ControlRequest = Union[StatusRequest, LoadRequest, UnloadRequest, DrillRequest, GuardUpdate, ReloadRequest]


class ControlOk(Msg, tag="ok", kw_only=True):
    detail: str = ""
    data: bytes = b""  # JSON, e.g. supervisor.policy.status.ServerStatus for a StatusRequest


class ControlError(Msg, tag="error", kw_only=True):
    code: ErrorCode
    message: str
    http_status: int = 400


ControlReply = Union[ControlOk, ControlError]
