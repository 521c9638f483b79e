"""Wired memory on macOS (SPEC M2, M3): what is said about wiring, how a stop escalates, and
whether a worker's exit stranded wired memory. Pure: numbers in, numbers and words out.

Why wired memory gets rules of its own: a residency set (`mx.set_wired_limit`)
under concurrent requests and cache churn is the reproduced trigger of the
IOGPU `completeMemory() prepare count underflow` kernel panic
(ml-explore/mlx#3186), so nothing is wired unless `[guard] wire_weights`
asks (M2); and a Metal process killed outright can leave wired memory that
only a reboot returns (oMLX #2184, #2855), so a stop never starts with
SIGKILL there, and memory an exit did not give back is counted as lost (M3).

The reading (the OS's wired count) is the probe's (shared/probe/macos.py);
the enforcer schedules the re-read and carries the verdict out. Public
names: WIRED_RETURN_SECONDS, STRANDED_NOISE, WiredBefore, sigkill_after,
stranded_after_exit, still_stranded, wiring_line.
"""

from __future__ import annotations

import msgspec

from shared.sizes import MiB

WIRED_RETURN_SECONDS = 5.0  # M3: wired memory not back this long after an exit is stranded
# A smaller rise of what is wired outside our workers is other processes wiring and unwiring
# between the two readings, not an exit that kept its memory.
STRANDED_NOISE = 64 * MiB
SIGKILL_AFTER_AT_MOST = 5.0  # off macOS: SIGTERM to SIGKILL, at most (the escalation's old rule)


def sigkill_after(stop_grace: float, macos: bool) -> float:
    """M3: seconds from SIGTERM to SIGKILL. On macOS the whole `stop_grace`: a worker that may
    hold a residency set is given every chance to exit on its own, since a kill can strand its
    wired memory until reboot. Elsewhere a kill strands nothing, and a stop is not held up longer
    than SIGKILL_AFTER_AT_MOST."""
    grace = max(0.0, stop_grace)
    return grace if macos else min(grace, SIGKILL_AFTER_AT_MOST)


class WiredBefore(msgspec.Struct, frozen=True, kw_only=True):
    """The guard's last reading before a worker exited (M3): what a re-read is compared with.

    `held` is the exited worker's GPU share then (Metal: MLX active + pool, the memory it could
    have wired); `wired` the OS's wired count then; `ours` every worker's GPU share then, the
    exited one included.
    """

    worker: str
    model: str
    held: int
    wired: int
    ours: int


def stranded_after_exit(before: WiredBefore, wired_now: int, ours_now: int) -> int:
    """M3: the bytes of the exited worker's wired memory that did not come back (0: it all did).

    The OS's wired count is ours plus everyone else's (the kernel, other apps, memory stranded
    earlier). What is not ours (wired - our workers' GPU share) stays the same across an exit that
    gave its memory back, whatever our other workers loaded meanwhile; what it grew by is what the
    exited worker left wired. At most what that worker held (other apps wiring more in the same
    seconds cannot be laid at its door), and nothing below STRANDED_NOISE.
    """
    grown = (wired_now - ours_now) - (before.wired - before.ours)
    stranded = min(max(0, before.held), grown)
    return stranded if stranded >= STRANDED_NOISE else 0


def still_stranded(stranded: int, wired_now: int, ours_now: int) -> int:
    """M3: memory found stranded is counted until it comes back, and it can never be more than
    what is wired outside our workers now: when that falls below it, the kernel gave some back."""
    return max(0, min(stranded, wired_now - ours_now))


def wiring_line(wire_weights: bool, macos: bool) -> str:
    """M2: what `serve`'s banner, `status` and the log say about wiring ("" when there is nothing to say)."""
    if wire_weights and macos:
        return ("macOS wiring ON ([guard] wire_weights = true): each worker wires min(residency ceiling, "
                "the C13 suggestion) with mx.set_wired_limit. A residency set under concurrent requests is "
                "the reproduced trigger of an IOGPU kernel panic (ml-explore/mlx#3186): turn it off unless "
                "you need it")
    if wire_weights:
        return "[guard] wire_weights = true has no effect here: only macOS workers wire memory (SPEC M2)"
    if macos:
        return "macOS wiring off (the default; [guard] wire_weights = true opts in)"
    return ""
