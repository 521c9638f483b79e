"""Is a worker alive? The heartbeat and wedge checks, as pure functions of timestamps.

A worker proves it is alive two ways: its step loop answers the pool's pings
on the command socket (`last_pong`), and a thread beside that loop reports
`Alive` on its own (`last_alive`), with how long the engine step in progress
has run. A loop inside one long MLX step cannot answer a ping, yet its
thread says it is computing; a SIGSTOPped process says nothing at all.

The pool keeps these times in each worker's `Beats` and asks the functions
here what they mean against the configured windows. They read no clock (the
caller passes `now`) and change nothing, so each rule is a table test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.protocol import Alive
    from supervisor.config import SupervisorConfig

# Seconds a new worker process has, beyond the heartbeat window, to start
# Python and report for the first time.
STARTUP_GRACE = 10.0


@dataclass(slots=True)
class Beats:
    """When a worker last showed it was alive (monotonic seconds). Written by the pool only."""

    spawned_at: float
    last_pong: float  # its step loop answered a ping (or said hello, or loaded)
    last_alive: float = 0.0  # its heartbeat thread reported (0: not yet)
    alive: Alive | None = None  # that report (how long the engine step in progress had run)


def step_seconds(b: Beats, now: float, scfg: SupervisorConfig) -> float:
    """How long the worker's current engine step has run, by its heartbeat thread's
    last report (0 when it is between steps or the report is stale)."""
    if b.alive is None or b.alive.step_seconds <= 0 or now - b.last_alive > scfg.heartbeat_timeout:
        return 0.0
    return b.alive.step_seconds + (now - b.last_alive)


def in_long_step(b: Beats, now: float, scfg: SupervisorConfig) -> bool:
    """Silent on its command socket, yet provably alive: its heartbeat thread reported
    within the window that the loop is inside one engine step (MLX computing), for
    less than step_timeout. A SIGSTOPped worker sends nothing; a loop stuck between
    steps says so."""
    return 0 < step_seconds(b, now, scfg) < scfg.step_timeout


def silent_while_loading(b: Beats, now: float, scfg: SupervisorConfig) -> bool:
    """A loading worker's heartbeat thread runs from before its Hello; once it has
    reported, silence past the heartbeat window means the process is stopped or
    stuck (else a SIGSTOP while loading would wait out the whole load_timeout, and
    every client waiting for the load with it)."""
    if b.last_alive == 0:  # not a word yet: the interpreter and its imports get a grace
        return now - b.spawned_at > scfg.heartbeat_timeout + STARTUP_GRACE
    return now - b.last_alive > scfg.heartbeat_timeout


def wedged(b: Beats, loading: bool, now: float, scfg: SupervisorConfig) -> str | None:
    """Why the worker counts as wedged now, in words for its event, or None.

    A worker busy loading weights cannot answer pings (the load blocks its
    loop), so until it has loaded it is judged by its heartbeat thread and the
    much longer load timeout instead."""
    if loading:
        if silent_while_loading(b, now, scfg):
            return f"no heartbeat for {now - (b.last_alive or b.spawned_at):.1f} s while starting or loading"
        if now - b.spawned_at > scfg.load_timeout:
            return f"still loading after {now - b.spawned_at:.0f} s"
        return None
    if now - b.last_pong <= scfg.heartbeat_timeout or in_long_step(b, now, scfg):
        return None
    step = step_seconds(b, now, scfg)
    if step > 0:
        return f"one engine step has run for {step:.0f} s (supervisor.step_timeout {scfg.step_timeout:g} s)"
    return f"no heartbeat for {now - b.last_pong:.1f} s"


def unresponsive(b: Beats, now: float, scfg: SupervisorConfig) -> float | None:
    """Seconds a serving worker has not answered a ping, once past half the heartbeat
    window (a SIGSTOPped worker, before it is killed as wedged); None otherwise. A
    router then sends its request elsewhere rather than wait."""
    silent = now - b.last_pong
    limit = max(2 * scfg.heartbeat_interval, scfg.heartbeat_timeout / 2)
    return silent if silent > limit and not in_long_step(b, now, scfg) else None


def forgiven(b: Beats, now: float, stalled: float, loading: bool) -> Beats:
    """The supervisor's own loop could not run for `stalled` seconds, so no worker's
    silence over that time is evidence (its heartbeats may sit unread in the
    socket): a fresh window from `now`; a loading worker's load timeout is pushed
    back by the stall."""
    return Beats(spawned_at=b.spawned_at + stalled if loading else b.spawned_at, last_pong=max(b.last_pong, now),
                 last_alive=max(b.last_alive, now) if b.last_alive else 0.0, alive=b.alive)


def handed_off(b: Beats, now: float) -> Beats:
    """W1: a spare was handed a model and loads it from now on: its load timeout counts from
    here (not from its start, maybe long ago), and its heartbeat thread keeps its record."""
    return Beats(spawned_at=now, last_pong=now, last_alive=b.last_alive, alive=b.alive)


def stall_threshold(scfg: SupervisorConfig) -> float:
    """How late a heartbeat may be before the supervisor's loop counts as stalled: a
    silence can only be judged on time the loop could observe. Half the window at
    most, so a stall just short of it is still forgiven."""
    return min(scfg.heartbeat_timeout / 2, max(0.5, scfg.heartbeat_interval))
