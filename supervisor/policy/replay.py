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

A trace is one of the places a tier name enters (T2): a line whose tier is
not one of the tiers by name (written by hand, or recorded before the name
was normalised where it enters) guards with its normalised name, or with
balanced when nobody knows it, and the first line that does so carries a
`Warn` saying which name was replaced, once per name. `state.tier_warned`,
which such traces carry, is dropped: that report is made here now.

Public names (stable): ReplayTick, BadLine, replay_lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from shared.vocab import PressureLevel
from supervisor.policy.decisions import Decision, Warn, per_worker
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import PolicyState, Snapshot
from supervisor.policy.tiers import normalise_tier


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


def _decode(raw: str | bytes) -> tuple[Snapshot, str | None]:
    """One line as a Snapshot, and the tier name it asked for when nobody knows it (T2).

    The strict decoder takes a line as the enforcer records it; a line it
    refuses is read again with its tier normalised and the retired
    `state.tier_warned` dropped, and is refused only if still not a snapshot.
    """
    try:
        return _decoder.decode(raw), None
    except msgspec.ValidationError as refused:
        line: Any = msgspec.json.decode(raw)
        guard = line.get("guard") if isinstance(line, dict) else None
        state = line.get("state") if isinstance(line, dict) else None
        asked = guard.get("tier") if isinstance(guard, dict) else None
        if not isinstance(asked, str) and not (isinstance(state, dict) and "tier_warned" in state):
            raise refused from None
        unknown = None
        if isinstance(guard, dict) and isinstance(asked, str):
            guard["tier"], known = normalise_tier(asked)
            unknown = None if known else asked
        if isinstance(state, dict):
            state.pop("tier_warned", None)
        return msgspec.convert(line, Snapshot), unknown


def replay_lines(lines: Iterable[str | bytes], *, chained: bool = True) -> Iterator[ReplayTick | BadLine]:
    """Tick every non-blank line in order; yield a ReplayTick or a BadLine each."""
    state: PolicyState | None = None
    warned: str | None = None  # T2: the unknown tier name already reported
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            snapshot, unknown = _decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            yield BadLine(line=number, error=f"not a policy snapshot: {exc}")
            continue
        if chained and state is not None:
            snapshot = msgspec.structs.replace(snapshot, state=state)
        result = tick(snapshot)
        state = result.state
        said: list[Decision] = []
        if unknown is not None and unknown != warned:
            said.append(Warn(reason="T2", message=(
                f"unknown memory guard tier {unknown!r}; using 'balanced' "
                "(choose safe, balanced, aggressive or custom)")))
        warned = unknown
        yield ReplayTick(
            line=number, now=snapshot.now, level=result.level, usage=result.usage,
            projected_usage=result.projected_usage, ceiling=result.ceilings.ceiling,
            emergency=result.emergency, next_interval=result.next_interval,
            decisions=said + per_worker(result.decisions),  # one line a worker, as ever
        )
