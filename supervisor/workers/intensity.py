"""Restart intensity and the backoff of a failed model: pure functions of times.

A pinned model whose worker dies comes back, but not for ever: as an OTP
supervisor allows at most `restart_max` restarts in `restart_period` seconds
(circus calls the same check flapping), past that the model is marked failed
and its requests get a clear error. A failed model is tried again after a
backoff that doubles up to `failed_retry_max`: never trying again left a
model failed until someone restarted the supervisor. Each respawn within the
intensity waits a short backoff of its own, so a crash loop does not spin.

These read no clock (the caller passes `now`) and keep nothing; `models.py`
keeps each model's restart times and failures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

RESPAWN_FIRST = 0.5  # seconds before the first respawn; each next one waits twice as long
RESPAWN_MAX = 10.0


def recent(restarts: Iterable[float], now: float, scfg: SupervisorConfig) -> list[float]:
    """The restarts that still count: those within the last `restart_period` seconds."""
    return [t for t in restarts if now - t <= scfg.restart_period]


def respawn_delay(recent_restarts: int, scfg: SupervisorConfig) -> float | None:
    """Seconds to wait before the next respawn, or None when the intensity is
    exhausted (`restart_max` restarts within the period): the model is failed."""
    if recent_restarts >= scfg.restart_max:
        return None
    return min(RESPAWN_MAX, RESPAWN_FIRST * 2 ** recent_restarts)


def failure_backoff(failures: int, last_failure: float, now: float, scfg: SupervisorConfig) -> tuple[int, float]:
    """A model fails (again): (its failures in a row now, seconds until its next try).

    The delay doubles from `failed_retry_first` up to `failed_retry_max`; a model
    that served for longer than twice that since its last failure starts over."""
    if failures and now - last_failure > 2 * scfg.failed_retry_max:
        failures = 0
    return failures + 1, min(scfg.failed_retry_max, scfg.failed_retry_first * 2.0 ** failures)
