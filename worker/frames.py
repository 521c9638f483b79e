"""What leaves the worker after a step, and when: tokens of running streams may wait a few ms.

Why hold tokens at all: every frame wakes ZeroMQ's I/O thread here and in the
supervisor, the supervisor's loop, an HTTP write and the client; a small
model on a CPU decodes a token every ~1 ms, so one stream meant ~1,000 of
each per second. On the 2-core test machine those wake-ups ran beside MLX's
two threads and one stream got 63-72 % of in-process `stream_generate`.
Steps faster than `interval` therefore put their tokens in one frame, as a
batched step already does for its rows (shared.protocol.coalesce).

What never waits: a request's first token (time to first token is what a
client sees first), and any event that is not a token of a stream already
flowing (`Prompted`, `Finished`, `Failed`, `NeedMemory`: the guard and the
front door act on those); they leave at once, with what was held before
them. Tokens are held only while the next step is another decode step of
the same streams (`steady`): before anything else runs (a prefill chunk may
take a second) or while the engine idles, what is held leaves. A step slower
than `interval` (a GPU step, a busy batch) sends its tokens at once: the
wait is at most `interval` and only where tokens come faster than that.
"""

from __future__ import annotations

from shared import protocol as p

FRAME_SECONDS = 0.005  # the longest a running stream's token waits for the next ones


class Frames:
    """Holds a step's tokens of flowing streams until `interval` passed since the last send."""

    def __init__(self, interval: float = FRAME_SECONDS) -> None:
        self.interval = interval
        self.held: list[p.Msg] = []
        self.flowing: set[str] = set()  # requests that have sent a token and not ended
        self.sent_at = 0.0

    def after_step(self, events: list[p.Msg], now: float, steady: bool) -> list[p.Msg]:
        """The frames to send now for a step's events (in order); the rest is held. `steady`:
        the engine's next step decodes the same streams and nothing else."""
        urgent = False
        for ev in events:
            if type(ev) is p.TokenOut:
                if ev.request_id not in self.flowing:
                    self.flowing.add(ev.request_id)
                    urgent = True
            else:
                urgent = True
                if isinstance(ev, (p.Finished, p.Failed)):
                    self.flowing.discard(ev.request_id)
        self.held.extend(events)
        if not self.held or (steady and not urgent and now - self.sent_at < self.interval):
            return []
        return self.flush(now)

    def flush(self, now: float) -> list[p.Msg]:
        """Everything held, its tokens in one frame (a request's tokens stay before its end)."""
        out, self.held = p.coalesce(self.held), []
        self.sent_at = now
        return out
