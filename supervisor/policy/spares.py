"""W1, W2: when a spare worker starts, and spares first under pressure.

A spare is a worker with MLX and the engine imported and no model (`model`
is ""), so that a load costs the weights and not Python's start. It is a
worker to the guard: its usage counts in U2 like any other. What is
particular to it is decided here:

- **start** (W1, W2): one at a time, while fewer than `spare_workers` are
  starting or waiting, the level is ok, and usage + what a spare is expected
  to hold <= the admission soft target (C9). Never while a model load is on
  its way or any request runs or waits (nor while a worker drains): a spare
  never delays a load or a prefill, it is made in the quiet after them. After
  spares died unasked, not before `spare_due` (the enforcer works it out with
  the restart intensity, so a spare that crashes at start does not loop).
- **stop first** (W2): at any pressure, before P6 step 1, every spare is
  stopped and its usage leaves the projection.
- **room** (A2, G1): a spare is the first victim when a load or a prefill
  needs room, before any idle model (supervisor.policy.admission takes
  `room_victims`).

Public names (stable): SPARE_BYTES_DEFAULT, keep_spares, stop_spares, room_victims.
"""

from __future__ import annotations

from shared.sizes import MiB, format_size
from shared.vocab import PressureLevel
from supervisor.policy.decisions import StartSpare, StopSpare
from supervisor.policy.group import WorkerGroup
from supervisor.policy.snapshot import WorkerRecord
from supervisor.policy.tickstate import Tick

# What a spare is expected to hold before one has been measured: Python, MLX, mlx-lm and
# the tokenizer stack on a CPU measured 170-200 MiB of anonymous memory (docs/swaps.md).
SPARE_BYTES_DEFAULT = 256 * MiB


def keep_spares(t: Tick, level: PressureLevel) -> None:
    """W1, W2: one StartSpare when a spare is missing and nothing stands against it; a
    StopSpare for each one over `spare_workers` (a reload lowered it)."""
    s, g = t.s, t.group
    wanted = s.guard.spare_workers
    for w in g.spares[wanted:]:
        if w.worker not in t.stopped:
            t.out.append(StopSpare(worker=w.worker, reason=f"more spare workers than the {wanted} configured"))
            t.gone(w)
    if len(g.spares) >= wanted or level != "ok" or s.now < s.spare_due:
        return
    if g.loading or g.active or s.loads_waiting:  # never beside a load or a request
        return
    size = s.spare_bytes or SPARE_BYTES_DEFAULT
    target = t.c.admission_soft_target
    if g.usage + size > target:
        return
    t.out.append(StartSpare(reason=(
        f"{len(g.spares)} of {wanted} spare worker(s): usage {format_size(g.usage)} + a spare's "
        f"{format_size(size)} fits under the admission soft target {format_size(target)}")))


def stop_spares(t: Tick, level: PressureLevel) -> None:
    """W2: under pressure, every spare goes first (before P6 step 1)."""
    if level == "ok":
        return
    for w in t.group.spares:
        t.out.append(StopSpare(worker=w.worker, reason=(
            f"{level} pressure: a spare is the first thing stopped (it holds {format_size(w.usage)})")))
        t.gone(w)


def room_victims(g: WorkerGroup) -> list[WorkerRecord]:
    """A2, G1: the spares, the first room a load or a prefill takes."""
    return list(g.spares)
