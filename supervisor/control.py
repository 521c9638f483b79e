"""Requests on the control socket (the CLI's door), answered by the arbiter.

Loads and unloads go through exactly the same path as HTTP, so the same
admission rules (SPEC A) apply whichever door a user knocks on.
"""

from __future__ import annotations

import logging

import msgspec

from shared import protocol as p
from supervisor.gate import GateClosed
from supervisor.pool import LoadError

log = logging.getLogger("memvisor.control")


async def handle_control(arbiter, msg) -> p.Msg:
    try:
        if isinstance(msg, p.StatusRequest):
            return p.ControlOk(data=msgspec.json.encode(arbiter.server_status()))
        if isinstance(msg, p.LoadRequest):
            handle = await arbiter.load(msg.model)
            return p.ControlOk(detail=f"{msg.model} is loaded (worker {handle.worker_id}, pid {handle.pid})")
        if isinstance(msg, p.UnloadRequest):
            done = await arbiter.unload(msg.model)
            return p.ControlOk(detail=f"{msg.model} unloaded" if done else f"{msg.model} was not loaded")
        if isinstance(msg, p.DrillRequest):
            return drill(arbiter, msg)
        if isinstance(msg, p.GuardUpdate):
            arbiter.enforcer.update_guard(msg)
            return p.ControlOk(detail="guard settings changed")
    except (LoadError, GateClosed) as exc:
        return p.ControlError(code=exc.code, message=str(exc), http_status=exc.http_status)
    except ValueError as exc:  # bad tier / ceiling in a GuardUpdate
        return p.ControlError(code="invalid_request", message=str(exc), http_status=400)
    return p.ControlError(code="unsupported", message=f"unsupported request {type(msg).__name__}")


def drill(arbiter, msg: p.DrillRequest) -> p.Msg:
    if not arbiter.config.supervisor.allow_drills:
        return p.ControlError(code="drills_disabled", http_status=403,
                              message="fire drills are off; start the supervisor with --allow-drills")
    handle = arbiter.pool.worker_for(msg.model)
    if handle is None or handle.state not in ("ready", "busy"):
        return p.ControlError(code="model_not_loaded", http_status=409,
                              message=f"{msg.model} is not loaded; load it first")
    if msg.stop:
        arbiter.pool.command(handle, p.DrillStop())
        return p.ControlOk(detail=f"drill on {msg.model} stopped")
    if msg.rate <= 0 or msg.to <= 0:
        return p.ControlError(code="invalid_request", message="rate and size must be positive")
    arbiter.pool.command(handle, p.Drill(rate=msg.rate, to=msg.to))
    arbiter.emit("drill", f"fire drill: {msg.rate} B/s up to {msg.to} B", worker_id=handle.worker_id,
                 model_id=msg.model)
    log.warning("fire drill on %s: growing %d B/s up to %d B", msg.model, msg.rate, msg.to)
    return p.ControlOk(detail=f"drill started on {msg.model} (worker pid {handle.pid})")
