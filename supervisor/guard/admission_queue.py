"""The admission gate: where new requests wait while pressure pauses admission.

SPEC P3 pauses new requests while the level is not ok; requests already
running continue, and a worker with nothing running still takes one. Waiting
is bounded twice, so a pressure episode can never pile up unbounded work or
hang clients forever: at most `size` requests wait, each for at most
`deadline` seconds. Past either the caller gets `GateClosed` (HTTP 503 with
Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Callable

from supervisor.doors.refusals import GateClosed
from supervisor.policy.admission import admits_request

if TYPE_CHECKING:
    from supervisor.workers.process import WorkerHandle


class _Waiter:
    __slots__ = ("handle", "future", "deadline", "wait")

    def __init__(self, handle: WorkerHandle, future: asyncio.Future, deadline: float, wait: float) -> None:
        self.handle = handle
        self.future = future
        self.deadline = deadline
        self.wait = wait


class Gate:
    def __init__(self, size: int, deadline: float) -> None:
        self.size = size
        self.deadline = deadline
        self.waiters: list[_Waiter] = []
        self.rejected_full = 0
        self.rejected_deadline = 0

    @property
    def depth(self) -> int:
        return len(self.waiters)

    def waiting_for(self, handle: WorkerHandle) -> int:
        """Requests queued here for one worker (a model's queue depth, a router's signal)."""
        return sum(1 for w in self.waiters if w.handle is handle and not w.future.done())

    def waiting_for_model(self, model_id: str) -> int:
        return sum(1 for w in self.waiters if w.handle.model_id == model_id and not w.future.done())

    async def wait(self, handle: WorkerHandle, deadline: float | None = None) -> None:
        """Return once `release` lets this request in; GateClosed when full or too late.

        `deadline`: seconds this request will wait at most, when shorter than the
        gate's own (a router's request that would rather try another host)."""
        if len(self.waiters) >= self.size:
            self.rejected_full += 1
            raise GateClosed(
                f"memory pressure has paused admission and {self.size} requests already wait; retry later",
                retry_after=max(1, int(self.deadline / 4)),
            )
        future = asyncio.get_running_loop().create_future()
        wait = self.deadline if deadline is None else min(self.deadline, deadline)
        waiter = _Waiter(handle, future, time.monotonic() + wait, wait)
        self.waiters.append(waiter)
        try:
            await future
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    def release(self, paused: bool, running: Callable[[WorkerHandle], int]) -> None:
        """Let waiters through, oldest first, as SPEC P3 admits them: everyone when
        not paused; while paused, one request per worker that runs nothing (the
        ones let through in this round count as running)."""
        taken: collections.Counter[int] = collections.Counter()
        for waiter in list(self.waiters):
            if waiter.future.done():
                continue
            handle = waiter.handle
            if not handle.live:
                waiter.future.set_result(None)  # the caller sees the dead worker
            elif admits_request(paused, running(handle) + taken[id(handle)]):
                taken[id(handle)] += 1
                waiter.future.set_result(None)

    def expire(self, now: float) -> None:
        for waiter in list(self.waiters):
            if not waiter.future.done() and now >= waiter.deadline:
                self.rejected_deadline += 1
                waiter.future.set_exception(GateClosed(
                    f"memory pressure kept admission paused for {waiter.wait:.0f} s; retry later",
                    retry_after=max(1, int(waiter.wait / 4)),
                ))
