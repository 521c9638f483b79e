"""Requests on the control socket (the CLI's door), answered through the
supervisor's narrow interface (`supervisor.doors.api.Supervisor`).

Loads and unloads go through exactly the same path as HTTP, so the same
admission rules (SPEC A) apply whichever door a user knocks on.
"""

from __future__ import annotations

import logging

import msgspec
from typing_extensions import assert_never

from shared import protocol as p
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError

log = logging.getLogger("memvisor.control")

# No model has a context near this; a count past it is a typo or an attack,
# and one past 2**64 could not even be encoded in the answer.
MAX_CONTEXT_TOKENS = (1 << 31) - 1


async def handle_control(sup: Supervisor, msg: p.ControlRequest) -> p.ControlReply:
    """The answer to one request; never an exception (the CLI waits for an answer)."""
    try:
        return await _answer(sup, msg)
    except ServeError as exc:
        return p.ControlError(code=exc.code, message=str(exc), http_status=exc.http_status)
    except ValueError as exc:  # bad tier / ceiling in a GuardUpdate
        return p.ControlError(code="invalid_request", message=str(exc), http_status=400)
    except Exception as exc:  # a bug must still answer the CLI, not leave it waiting
        log.exception("control request %s failed", type(msg).__name__)
        return p.ControlError(code="internal_error", message=f"the supervisor failed: {exc!r}", http_status=500)


async def _answer(sup: Supervisor, msg: p.ControlRequest) -> p.ControlReply:
    match msg:
        case p.StatusRequest():
            return p.ControlOk(data=msgspec.json.encode(sup.server_status()))
        case p.LoadRequest(dry_run=True):
            if not 0 <= msg.context <= MAX_CONTEXT_TOKENS:
                return p.ControlError(code="invalid_request", http_status=400,
                                      message=f"context must be 0..{MAX_CONTEXT_TOKENS} tokens, got {msg.context}")
            report = await sup.fit(msg.model, msg.context)
            return p.ControlOk(detail=report.message, data=msgspec.json.encode(report))
        case p.LoadRequest():
            handle = await sup.load(msg.model, explicit=True)
            return p.ControlOk(detail=f"{msg.model} is loaded (worker {handle.worker_id}, pid {handle.pid})")
        case p.UnloadRequest():
            done = await sup.unload(msg.model, admin=True)  # the socket is in a 0700 folder: its owner
            return p.ControlOk(detail=f"{msg.model} unloaded" if done else f"{msg.model} was not loaded")
        case p.DrillRequest():
            return p.ControlOk(detail=sup.start_drill(msg))
        case p.GuardUpdate():
            sup.update_guard(msg)
            return p.ControlOk(detail="guard settings changed")
        case p.ReloadRequest():
            return p.ControlOk(detail=await sup.reload("asked over the control socket"))
        case _:
            assert_never(msg)
