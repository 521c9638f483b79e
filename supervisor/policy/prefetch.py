"""SPEC W4, prefetch: which unloaded model is likely asked for next, and whether
its weights may be read ahead now.

Reading a model's weights into the OS page cache before it is asked for
turns the disk read of its next load into a memory copy. The page cache is
file-backed and reclaimable: it is no process's usage (U1), and the OS gives
it up before it swaps anything. The guard still lets it happen only while
the level is ok and the dynamic ceiling has room for the whole model, and it
stops at soft.

The prediction, in order:

  1. the model that most often came right after the model asked for last,
     in the sequence of requests seen (a client that alternates between two
     models, or a pipeline a -> b -> c, is found here after one round);
     among equals, the one used more recently;
  2. else the unloaded model used most recently (last-used order);
  3. never a model that was never asked for: nothing says it is coming.

Pure: no clock, no I/O; the carrying out is `supervisor.models.prefetch`.

Public names (stable): Candidate, followers, likely_next, room, may_prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shared.vocab import PressureLevel


class Candidate(msgspec.Struct, frozen=True):
    """An unloaded model that could be read ahead."""

    model: str
    size: int          # its weights, A2's estimate (0: not read yet)
    last_used: float   # monotonic time its last worker was last used (0: never loaded here)


def followers(sequence: Sequence[str], after: str) -> dict[str, int]:
    """How often each model came right after `after` in the sequence of models asked for."""
    counts: dict[str, int] = {}
    for first, then in zip(sequence, sequence[1:]):
        if first == after and then != after:
            counts[then] = counts.get(then, 0) + 1
    return counts


def likely_next(candidates: Sequence[Candidate], sequence: Sequence[str]) -> str | None:
    """W4: the candidate most likely asked for next (the module's order), or None."""
    if not candidates:
        return None
    asked = set(sequence)
    if sequence:
        counts = followers(sequence, sequence[-1])
        known = [c for c in candidates if c.model in counts]
        if known:
            return max(known, key=lambda c: (counts[c.model], c.last_used, c.model)).model
    used = [c for c in candidates if c.last_used > 0 or c.model in asked]
    if not used:
        return None
    return max(used, key=lambda c: (c.last_used, c.model)).model


def room(*, dynamic: int, static: int, usage: int) -> int:
    """Bytes the dynamic ceiling has left above the group's usage (the static one when there is no
    dynamic term); what a prefetch may fill."""
    ceiling = dynamic if dynamic > 0 else static
    return max(0, ceiling - usage)


def may_prefetch(*, level: PressureLevel, room_bytes: int, size: int) -> bool:
    """W4: only at ok, only a model whose weights are known, only when the room holds all of them."""
    return level == "ok" and 0 < size <= room_bytes
