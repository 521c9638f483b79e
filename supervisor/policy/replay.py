"""Replay a recorded trace of policy inputs (one Snapshot per JSON line).

Because the policy is pure, a trace recorded by the enforcer (or written by
hand) replays to exactly the decisions it produced, on any machine. Two ways
to carry the policy's state from line to line:

- chained (default): the first good line's `state` starts the run and every
  tick's new state feeds the next line; the recorded `state` of later lines is
  ignored. This is what the live enforcer does, so a hand-written trace only
  needs a state on its first line (or none).
- recorded: every line is ticked with its own recorded `state`, so one line
  can be examined on its own, exactly as the enforcer saw it.

A bad line is reported with its line number and skipped; the rest replays.

Public names (stable): ReplayTick, BadLine, replay_lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec

from shared.vocab import PressureLevel
from supervisor.policy.decisions import Decision
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import PolicyState, Snapshot


class ReplayTick(msgspec.Struct, frozen=True, kw_only=True):
    """One output line: what the policy decided for trace line `line`."""

    line: int
    now: float
    level: PressureLevel
    usage: int
    projected_usage: int
    ceiling: int
    emergency: bool
    next_interval: float
    decisions: list[Decision]


class BadLine(msgspec.Struct, frozen=True, kw_only=True):
    line: int
    error: str


_decoder = msgspec.json.Decoder(Snapshot)


def replay_lines(lines: Iterable[str | bytes], *, chained: bool = True) -> Iterator[ReplayTick | BadLine]:
    """Tick every non-blank line in order; yield a ReplayTick or a BadLine each."""
    state: PolicyState | None = None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            snapshot = _decoder.decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            yield BadLine(line=number, error=f"not a policy snapshot: {exc}")
            continue
        if chained and state is not None:
            snapshot = msgspec.structs.replace(snapshot, state=state)
        result = tick(snapshot)
        state = result.state
        yield ReplayTick(
            line=number, now=snapshot.now, level=result.level, usage=result.usage,
            projected_usage=result.projected_usage, ceiling=result.ceilings.ceiling,
            emergency=result.emergency, next_interval=result.next_interval,
            decisions=result.decisions,
        )
