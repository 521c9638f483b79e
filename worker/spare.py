"""A spare worker's wait (SPEC W1): MLX and the engine imported, no model, until a load names one.

Why a wait of its own and not the step loop with no engine: a spare has no
engine to step, no requests, no prompt cache; what it must do is prove it is
alive (pings), show its memory (samples, U2 counts it), obey a drain (under
pressure spares go first, W2) and take its model (`TakeModel`). Everything
else a supervisor might send it is answered at once and changes nothing, so a
mistake on the other side never makes a spare hang or serve.

The hand-off is checked here: the spec it is given must keep the spare's own
identity (worker id, ledger slot and path, endpoints, supervisor), since the
process, its sockets and its slot stay what they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from typing_extensions import assert_never

from shared import protocol as p
from shared.limits import Limits

log = logging.getLogger("memvisor.worker")

# the fields of a start spec that name the process, which a hand-off may not change
_IDENTITY = ("worker_id", "slot", "ledger_path", "commands", "reports", "supervisor_pid")


def handoff_refusal(mine: p.WorkerSpec, given: p.WorkerSpec) -> str | None:
    """Why a spare with start spec `mine` cannot take `given`, or None when it can."""
    if not mine.spare:
        return "this worker already serves a model; only a spare takes one"
    if given.spare:
        return "the hand-off names no model"
    for field in _IDENTITY:
        if getattr(given, field) != getattr(mine, field):
            return f"the hand-off's {field} is not this spare's"
    return None


class SpareWait:
    """Obeys the commands a spare can get; `taken` is the spec it took, `draining` a drain."""

    def __init__(self, spec: p.WorkerSpec, reply: Callable[[p.Msg], None], reclaim: Callable[[], int]) -> None:
        self.spec = spec
        self.reply = reply
        self.reclaim = reclaim
        self.limits = Limits()
        self.taken: p.WorkerSpec | None = None
        self.draining = False

    @property
    def over(self) -> bool:
        return self.taken is not None or self.draining

    def obey(self, msg: p.CommandMsg) -> None:
        match msg:
            case p.Ping():
                self.reply(p.Pong(seq=msg.seq))
            case p.SetLimits():
                self.limits = msg.limits
            case p.TakeModel():
                self.take(msg)
            case p.Drain():
                log.info("spare drained: %s", msg.reason or "asked by the supervisor")
                self.draining = True
                self.reply(p.Ack(cmd=msg.cmd))
            case p.Reclaim():
                self.reply(p.Reclaimed(cmd=msg.cmd, freed_bytes=self.reclaim()))
            case p.ShrinkCache():
                self.reply(p.Reclaimed(cmd=msg.cmd, freed_bytes=0))  # no prompt cache to shrink
            case p.AbortRequests():
                self.reply(p.Ack(cmd=msg.cmd))  # nothing runs
            case p.Drill() | p.DrillStop():
                self.reply(p.Ack(cmd=msg.cmd, ok=False, detail="a spare has no model to drill"))
            case p.Generate() | p.Embed() | p.Tokenize() | p.Detokenize():
                self.reply(p.Failed(request_id=msg.request_id, code="worker_exited",
                                    message="this worker is a spare: it has no model yet"))
            case p.MemoryAnswer():
                pass  # it asked nothing
            case _:
                assert_never(msg)

    def take(self, msg: p.TakeModel) -> None:
        why = handoff_refusal(self.spec, msg.spec)
        if why is not None:
            log.error("refused a hand-off: %s", why)
            self.reply(p.LoadFailed(error=f"the spare refused the hand-off: {why}"))
            self.draining = True  # the supervisor stops it: a spare that was sent a wrong spec is not trusted
            return
        log.info("spare takes model %s from %s", msg.spec.model_id, msg.spec.model_path)
        self.taken = msg.spec
