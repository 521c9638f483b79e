"""What the pool says of a load as it goes (SPEC W6) and once it is over (W3).

The clock's arithmetic is supervisor.workers.load_clock's; this is the part that
needs the loop (a load no request waited for is closed after a short window)
and the pool's event sink. It changes the clocks, never the handles.
"""

from __future__ import annotations

import asyncio
import time

from shared import protocol as p
from supervisor.workers.load_clock import (
    FIRST_REQUEST_WINDOW,
    LoadClock,
    first_token,
    loaded,
    phase_words,
    progress,
    progress_words,
    report,
)
from supervisor.workers.process import EventSink, LoadReported, WorkerHandle


class LoadTimer:
    """The pool hands over each message that moves a load's clock; this says the
    progress (W6) and, once the load is over, its phases (W3) as `LoadReported`."""

    def __init__(self, on_event: EventSink) -> None:
        self.on_event = on_event

    def began(self, handle: WorkerHandle) -> None:
        """A worker was chosen for the load (spawned, or a spare handed the model): the first word of its progress."""
        clock = handle.load
        if clock is not None:
            r = report(clock, clock.chosen)
            self.on_event(LoadReported(handle, r, False, f"loading {handle.model_id}: {progress_words(r)}"))

    def loaded(self, handle: WorkerHandle, msg: p.Loaded, now: float) -> None:
        clock = handle.load
        if clock is None:
            return
        loaded(clock, msg, now)
        asyncio.get_running_loop().call_later(FIRST_REQUEST_WINDOW, self._no_request, handle, clock)

    def reply(self, handle: WorkerHandle, msg: p.WorkerReply) -> None:
        """The load's first request answered: its first token closes the load's phases
        (an answer without a token closes them without that phase)."""
        clock = handle.load
        if clock is None or clock.closed:
            return
        if isinstance(msg, (p.TokenOut, p.TokenBatch)):
            first_token(clock, time.monotonic())
            self._done(handle, clock)
        elif isinstance(msg, (p.Finished, p.Failed, p.Embedded)) and msg.request_id == clock.first_request:
            self._done(handle, clock)

    def alive(self, handle: WorkerHandle, msg: p.Alive) -> None:
        clock, now = handle.load, time.monotonic()
        if clock is not None and progress(clock, msg, now):
            r = report(clock, now)
            self.on_event(LoadReported(handle, r, False, f"loading {handle.model_id}: {progress_words(r)}"))

    def _no_request(self, handle: WorkerHandle, clock: LoadClock) -> None:
        """No request was waiting for the load (an explicit load, a pinned model): its phases end at `loaded`."""
        if handle.load is clock and not clock.first_request:
            self._done(handle, clock)

    def _done(self, handle: WorkerHandle, clock: LoadClock) -> None:
        if clock.closed:
            return
        clock.closed = True
        r = report(clock, time.monotonic())
        self.on_event(LoadReported(handle, r, True, f"load of {handle.model_id}: {phase_words(r)}"))

