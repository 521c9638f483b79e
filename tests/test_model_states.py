"""A model's state table (supervisor.models.model_states) and its restart intensity and
backoff (supervisor.workers.intensity): every legal move, illegal moves said loudly, and
the arithmetic of when a model comes back, as tables."""

import pytest

from supervisor.config import SupervisorConfig
from supervisor.models.model_states import MODEL_TRANSITIONS, IllegalMove, model_transition
from supervisor.workers import intensity

SCFG = SupervisorConfig(restart_max=3, restart_period=60.0, failed_retry_first=5.0, failed_retry_max=80.0)


@pytest.mark.parametrize("state, event, after", [
    ("steady", "load", "loading"),
    ("loading", "done", "steady"),
    ("steady", "exit", "respawning"),  # its pinned worker exited
    ("loading", "exit", "respawning"),  # it died while loading
    ("respawning", "load", "loading"),  # the respawn (due, or a request came first)
    ("respawning", "done", "respawning"),  # a load that ended after its worker exited
    ("loading", "give_up", "failed"),
    ("respawning", "give_up", "failed"),
    ("failed", "done", "failed"),  # a load that ended after the model was given up
    ("failed", "give_up", "failed"),
    ("failed", "retry", "steady"),
])
def test_each_legal_move(state, event, after):
    assert model_transition(state, event) == after


@pytest.mark.parametrize("state, event", [
    ("steady", "done"),  # no load in flight to end
    ("steady", "retry"),  # nothing failed
    ("loading", "load"),  # a second load of one model: callers join the one in flight (A5)
    ("respawning", "exit"),  # already coming back
    ("failed", "load"),  # a failed model loads only after a retry
    ("failed", "exit"),
])
def test_an_illegal_move_raises_instead_of_undoing_a_decision(state, event):
    with pytest.raises(IllegalMove, match=f"{state!r} cannot take event {event!r}"):
        model_transition(state, event)


def test_every_state_can_be_left_or_given_up():
    assert all("give_up" in moves for moves in MODEL_TRANSITIONS.values())


def test_restart_intensity_allows_restart_max_within_the_period_with_a_doubling_backoff():
    assert [intensity.respawn_delay(n, SCFG) for n in range(4)] == [0.5, 1.0, 2.0, None]
    assert intensity.respawn_delay(0, SupervisorConfig(restart_max=0)) is None
    assert intensity.respawn_delay(6, SupervisorConfig(restart_max=10)) == intensity.RESPAWN_MAX


def test_only_restarts_within_the_period_count():
    assert intensity.recent([0.0, 30.0, 59.0], 100.0, SCFG) == [59.0]
    assert intensity.recent([40.0, 41.0], 100.0, SCFG) == [40.0, 41.0]


def test_the_failed_backoff_doubles_with_each_failure_and_starts_over_after_a_quiet_spell():
    """intensity.failure_backoff's arithmetic alone; the retry it schedules runs through Models
    in test_restart_intensity_r_respawns_within_p_seconds_then_failed_with_a_doubling_backoff."""
    failures, delays, last = 0, [], 0.0
    for now in (0.0, 10.0, 30.0, 70.0, 200.0):
        failures, delay = intensity.failure_backoff(failures, last, now, SCFG)
        last = now
        delays.append(delay)
    assert delays == [5.0, 10.0, 20.0, 40.0, 80.0]
    # served for longer than twice the cap since its last failure: the backoff starts over
    assert intensity.failure_backoff(5, 200.0, 400.0, SCFG) == (1, 5.0)


# ---------------------------------------------------------------------------
# the respawn decisions themselves: Models (supervisor/models/life.py) driving intensity.py


class Clock:
    """The `time` Models reads: a clock the test moves (asyncio keeps its own)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class NoSpares:
    """The pool's spares (W1), as Models tells them a load begins and ends."""

    def load_begins(self) -> None:
        pass

    def load_ends(self) -> None:
        pass


class NoWorker:
    """The pool, as Models asks it while the pinned model's worker is down: none is up."""

    spares = NoSpares()

    def worker_for(self, model_id: str) -> None:
        return None


class Unmeasured:
    """The enforcer before its first tick, as `Models.tick`'s prefetch (W4) reads it: nothing to decide on."""

    last = last_snapshot = None


class Exited:
    """What `Models.on_exit` reads of a worker that died (a fresh one: no spare took its load)."""

    pinned, model_id, exit_cause, load, leaving = True, "m", "killed by SIGKILL", None, None


def _models(monkeypatch, tmp_path, **scfg):
    """The real Models and Catalog for one pinned model whose files are gone, so each respawn's
    load fails as a crashing worker's would, and the test's clock."""
    from supervisor.config import Config, ModelConfig
    from supervisor.guard.counters import SupervisorCounters
    from supervisor.guard.eventlog import EventLog
    from supervisor.models import life as models_module
    from supervisor.models.catalog import Catalog
    from supervisor.models.life import Models

    clock = Clock()
    monkeypatch.setattr(models_module, "time", clock)
    config = Config(supervisor=SupervisorConfig(**scfg), models=[ModelConfig(id="m", path=str(tmp_path / "gone"),
                                                                             pinned=True)])
    events, counters = EventLog(), SupervisorCounters()
    catalog = Catalog(config, emit=events.emit, counters=counters, discovered_refused={})
    models = Models(config, catalog=catalog, pool=NoWorker(), enforcer=Unmeasured(), emit=events.emit,  # type: ignore[arg-type]
                    wake=lambda: None, counters=counters, running=lambda: True)
    return models, clock, counters


async def _respawn(models, clock, after: float = 0.0) -> float:
    """Move the clock to the respawn's due time, let `tick` start it, move the clock on by
    `after` while its load fails, and wait for the decision; the delay it chose next."""
    import asyncio

    life = models.life("m")
    clock.now = life.due
    models.tick(clock.now)
    clock.now += after
    for _ in range(2000):
        await asyncio.sleep(0.005)
        if life.load is None and life.state in ("respawning", "failed"):
            return life.due - clock.now
    raise AssertionError(f"the respawn never settled: {life.state}")


def test_restart_intensity_r_respawns_within_p_seconds_then_failed_with_a_doubling_backoff(monkeypatch, tmp_path):
    """A pinned model that keeps dying, through the real decision code (Models.on_exit,
    schedule_respawn, tick, give_up, retry; intensity's arithmetic): 3 respawns 0.5, 1, 2 s
    apart, then failed naming the intensity; tried again after 5 s with a fresh history,
    failed again, and the next try 10 s away.
    Only a live test pinned this before: breaking the count (not recording a restart,
    `>` for `>=`) left every fast test green."""
    import asyncio

    models, clock, counters = _models(monkeypatch, tmp_path, restart_max=3, restart_period=60.0,
                                      failed_retry_first=5.0, failed_retry_max=80.0)

    async def until_failed() -> list[float]:
        delays = []
        for _ in range(8):  # bounded: a count that never reaches the intensity must not hang the test
            delays.append(await _respawn(models, clock))
            if models.life("m").state == "failed":
                break
        return delays

    async def main():
        models.on_exit(Exited())
        delays = [models.life("m").due - clock.now] + await until_failed()
        first = (delays, models.view("m").reason, models.restarts("m"), counters.respawns)
        return first, await until_failed()  # its backoff passes: tried again, and fails again

    (delays, reason, restarts, respawns), again = asyncio.run(main())
    assert delays == [0.5, 1.0, 2.0, 5.0]  # the 4th: the failed model's next try
    assert "3 restarts within 60 s" in reason and restarts == 3 and respawns == 3
    # the try counts as the first restart of a fresh history; failed twice in a row: 10 s, doubled
    assert again == [1.0, 2.0, 10.0]


def test_restarts_further_apart_than_the_period_never_fail_the_model(monkeypatch, tmp_path):
    """Ten crashes, each 61 s after the last respawn (period 60 s): each is the first within
    the period, so each respawn waits the first backoff and the model is never failed."""
    import asyncio

    models, clock, _ = _models(monkeypatch, tmp_path, restart_max=3, restart_period=60.0)

    async def main():
        models.on_exit(Exited())
        return [await _respawn(models, clock, after=61.0) for _ in range(10)]

    delays = asyncio.run(main())
    assert delays == [0.5] * 10 and models.life("m").state == "respawning"
