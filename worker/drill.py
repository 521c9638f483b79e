"""The fire drill: grow real MLX allocations at a set rate up to a set size.

Why real allocations: the point is to prove the guard on the user's own
machine and to time the benchmarks' reactions, so the memory must be what a
runaway model would take, committed pages that the OS has to find, not a
number written into a sample. Each piece is an MLX array filled with ones and
evaluated, which writes every page.

The drill does not own a thread or a clock: the worker loop calls `advance(now)`
at every step boundary (busy or idle) and the drill allocates what the rate
allows since it started. `release()` drops every array and returns the pool,
so the memory goes back to the OS at once.
"""

from __future__ import annotations

import mlx.core as mx

from shared.sizes import MiB, format_size

PIECE_BYTES = 64 * MiB   # largest single array, so one advance never stalls long
MIN_STEP_BYTES = 1 * MiB  # below this, wait for the next advance (no confetti of tiny arrays)
# One advance allocates at most what the rate gives in this many seconds. A
# machine that cannot allocate as fast as asked then falls behind the schedule
# instead of stalling the worker's loop in ever bigger catch-up allocations
# (which would also delay the very commands meant to stop the drill).
ADVANCE_SLICE = 0.01


class DrillError(ValueError):
    """A drill that cannot run as asked; the message says why."""


class DrillAllocation:
    """Allocate `rate` bytes per second from `now` until `target` bytes are held."""

    def __init__(self, rate: int, target: int, now: float, *, piece_bytes: int = PIECE_BYTES):
        if rate <= 0:
            raise DrillError(f"drill rate must be positive, got {rate} B/s")
        if target <= 0:
            raise DrillError(f"drill size must be positive, got {target} B")
        self.rate = int(rate)
        self.target = int(target)
        self.started = now
        self.piece_bytes = max(MIN_STEP_BYTES, int(piece_bytes))
        self._pieces: list[mx.array] = []
        self.held = 0

    @property
    def done(self) -> bool:
        return self.held >= self.target

    def due(self, now: float) -> int:
        """Bytes the drill should hold at `now` (the rate's schedule, capped at target)."""
        elapsed = max(0.0, now - self.started)
        return min(self.target, int(self.rate * elapsed))

    def next_due(self, now: float) -> float | None:
        """Seconds until the next allocation is worth making (for the loop's poll timeout)."""
        if self.done:
            return None
        owed = self.due(now) - self.held
        step = min(MIN_STEP_BYTES, self.target - self.held)
        return max(0.0, (step - owed) / self.rate)

    def advance(self, now: float) -> int:
        """Allocate what the rate allows since the start, at most one slice; the bytes added."""
        owed = self.due(now) - self.held
        if owed <= 0 or (owed < MIN_STEP_BYTES and self.held + owed < self.target):
            return 0
        size = min(owed, self.piece_bytes, max(MIN_STEP_BYTES, int(self.rate * ADVANCE_SLICE)))
        piece = mx.ones((size,), dtype=mx.uint8)
        mx.eval(piece)
        self._pieces.append(piece)
        self.held += size
        return size

    def release(self) -> int:
        """Free every piece and return the pool to the OS; the bytes that were held."""
        held = self.held
        self._pieces.clear()
        self.held = 0
        mx.clear_cache()
        return held

    def start_words(self) -> str:
        """The drill's event as people read it ("drill started: 64 MiB/s up to 1 GiB"). The
        worker's event is the drill's only one: it says the drill runs, which the command
        that asked for it cannot know."""
        return f"drill started: {format_size(self.rate)}/s up to {format_size(self.target)}"

    def release_words(self, why: str) -> str:
        """Release it (as `release`), in words for its event: "drill released 512 MiB: why"."""
        return f"drill released {format_size(self.release())}: {why}"
