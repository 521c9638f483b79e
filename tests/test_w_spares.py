"""SPEC W1, W2 (spare workers) and W3, W6 (a load's phases and progress), as tables.

The policy's part: when a spare starts, that spares are stopped first under
pressure and are the first room a load or a prefill takes. The worker state
table's new row, the hand-off's checks, the spares' restart backoff and the
load clock's arithmetic, each without a process. Same guard as
tests/test_a_admission.py: custom tier, 10 GiB ceiling, soft 8 GiB.
"""

from __future__ import annotations

import pytest

from shared import protocol as p
from shared.host import HostCounters
from shared.sizes import GiB, MiB
from shared.states import IllegalMove, transition
from supervisor.config import SupervisorConfig
from supervisor.policy import decisions as d
from supervisor.policy.admission import admit_load, prefill_room
from supervisor.policy.group import WorkerGroup
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.spares import SPARE_BYTES_DEFAULT
from supervisor.workers import load_clock
from supervisor.workers.spares import next_start
from tests.records import record
from worker.spare import handoff_refusal

GUARD = GuardSettings(tier="custom", custom_ceiling=10 * GiB, soft_threshold=0.8, hard_threshold=0.9,
                      spare_workers=1)
HOST = HostCounters(total=64 * GiB)


def w(name: str, gib: float, **kw) -> WorkerRecord:
    size = int(gib * GiB)
    kw.setdefault("model", f"m-{name}")
    return record(worker=name, usage=size, footprint=size, **kw)


def spare(name: str = "spare#9", gib: float = 0.25, state: str = "spare") -> WorkerRecord:
    return w(name, gib, model="", state=state)


def snap(*workers: WorkerRecord, guard: GuardSettings = GUARD, **kw) -> Snapshot:
    return Snapshot(now=1000.0, guard=guard, host=HOST, workers=list(workers), **kw)


def kinds(s: Snapshot) -> list[str]:
    return [d.kind_of(x) for x in tick(s).decisions if d.kind_of(x) != "hand_out_limits"]


# -- W1, W2: when a spare starts ------------------------------------------------------------


def test_w1_a_spare_starts_when_none_is_there_and_it_fits():
    assert kinds(snap(w("a", 1.0))) == ["start_spare"]


@pytest.mark.parametrize("why, s", [
    ("spare_workers = 0", snap(guard=GuardSettings(tier="custom", custom_ceiling=10 * GiB, soft_threshold=0.8,
                                                   hard_threshold=0.9))),
    ("one is waiting", snap(spare())),
    ("one is starting", snap(spare(state="starting"))),
    ("a model loads", snap(w("a", 1.0, state="loading"))),
    ("a load waits for admission", snap(loads_waiting=1)),
    ("a request runs", snap(w("a", 1.0, state="busy", running=1))),
    ("a request waits", snap(w("a", 1.0, queued=1))),
    ("a worker drains", snap(w("a", 1.0, state="draining"))),
    ("spares died lately", snap(spare_due=1000.5)),
])
def test_w1_no_spare_starts_while(why, s):
    """A spare never delays a load or a prefill: it is made in the quiet after them."""
    assert "start_spare" not in kinds(s), why


def test_w2_no_spare_starts_under_pressure():
    """Soft pressure (8.5 GiB > soft 8 GiB) with a request-free group: no spare, though none is there."""
    assert "start_spare" not in kinds(snap(w("a", 8.5)))


def test_w2_no_spare_starts_when_usage_and_its_expected_size_pass_the_admission_soft_target():
    # 7.9 GiB + the last spare's 200 MiB > 8 GiB: no room, though the level is ok
    assert "start_spare" not in kinds(snap(w("a", 7.9), spare_bytes=200 * MiB))
    assert kinds(snap(w("a", 7.6), spare_bytes=200 * MiB)) == ["start_spare"]
    # none measured yet: the default is what a spare is expected to hold
    assert "start_spare" not in kinds(snap(w("a", 8 - SPARE_BYTES_DEFAULT / GiB + 0.01)))


def test_w1_spares_over_the_configured_number_are_stopped():
    """A reload lowered spare_workers: the spares over it go."""
    decisions = tick(snap(spare("spare#1"), spare("spare#2"))).decisions
    assert [x.worker for x in decisions if isinstance(x, d.StopSpare)] == ["spare#2"]


# -- W2: spares first under pressure, and the first room -------------------------------------


def test_w2_under_pressure_the_spare_is_stopped_before_any_model():
    """Soft: 8.2 GiB > 8 GiB with two idle models; stopping the 0.5 GiB spare is enough,
    so P6 stops no model."""
    s = snap(w("a", 3.85, last_access=1), w("b", 3.85, last_access=2), spare(gib=0.5))
    decisions = [x for x in tick(s).decisions if isinstance(x, (d.StopSpare, d.Stop))]
    assert [(type(x).__name__, x.worker) for x in decisions] == [("StopSpare", "spare#9")]


def test_w2_the_spare_goes_first_and_p6_evicts_the_rest():
    s = snap(w("a", 4.5, last_access=1), w("b", 4.5, last_access=2), spare(gib=0.25))
    decisions = [x for x in tick(s).decisions if isinstance(x, (d.StopSpare, d.Stop))]
    assert [(type(x).__name__, x.worker) for x in decisions] == [("StopSpare", "spare#9"), ("Stop", "a")]


def test_w2_a_starting_spare_is_stopped_under_pressure_too():
    s = snap(w("a", 8.5), spare(state="starting"))
    assert [x.worker for x in tick(s).decisions if isinstance(x, d.StopSpare)] == ["spare#9"]


def test_a2_a_spare_is_room_before_any_idle_model():
    """6.9 GiB + 1.5 GiB > 8 GiB: stopping the 0.5 GiB spare makes room; the idle model stays."""
    s = snap(w("idle", 6.4, last_access=1), spare(gib=0.5))
    v = admit_load(s, "new", int(1.5 * GiB))
    assert v.admitted and v.evict == ["spare#9"]


def test_a2_spare_then_idle_models_when_the_spare_is_not_enough():
    s = snap(w("idle", 6.4, last_access=1), spare(gib=0.5))
    assert admit_load(s, "new", 2 * GiB).evict == ["spare#9", "idle"]


def test_g1_a_prefill_takes_the_spare_first():
    s = snap(w("asking", 4.0, state="busy", running=1), w("idle", 1.0), spare(gib=0.5))
    assert prefill_room(s, "asking", 400 * MiB).stop == ["spare#9"]


def test_w1_a_spare_is_neither_serving_nor_loading_nor_unknown():
    g = WorkerGroup(snap(spare(), spare("spare#8", state="starting"), w("a", 1.0)))
    assert [x.worker for x in g.spares] == ["spare#9", "spare#8"]
    assert [x.worker for x in g.serving] == ["a"] and not g.loading and not g.unknown and not g.active
    assert g.usage == int(1.5 * GiB)  # U2 counts it


# -- the worker state table's spare row -----------------------------------------------------


def test_w1_a_spare_waits_then_loads_its_model():
    assert transition("starting", "wait") == "spare"
    assert transition("spare", "take") == "loading"
    assert transition("spare", "stop") == "draining" and transition("spare", "silent") == "wedged"
    assert transition("spare", "exit") == "dead"
    assert transition("draining", "wait") == "draining"  # a late hello: a stop is final


@pytest.mark.parametrize("state, event", [("spare", "hello"), ("spare", "loaded"), ("spare", "work"),
                                          ("ready", "take"), ("loading", "wait")])
def test_w1_illegal_spare_moves_are_refused(state, event):
    with pytest.raises(IllegalMove):
        transition(state, event)


# -- the hand-off, checked by the spare --------------------------------------------------------

SPARE_SPEC = p.WorkerSpec(worker_id="spare#3", model_id="", model_path="", slot=2, ledger_path="/l",
                          commands="ipc://c", reports="ipc://r", supervisor_pid=7)


def given(**kw) -> p.WorkerSpec:
    fields = {f: getattr(SPARE_SPEC, f) for f in SPARE_SPEC.__struct_fields__}
    return p.WorkerSpec(**{**fields, "model_id": "m", "model_path": "/m", **kw})


def test_w1_a_spare_takes_a_spec_that_keeps_its_identity():
    assert handoff_refusal(SPARE_SPEC, given(max_concurrency=8)) is None


@pytest.mark.parametrize("change, words", [
    ({"worker_id": "m#4"}, "worker_id"), ({"slot": 3}, "slot"), ({"ledger_path": "/other"}, "ledger_path"),
    ({"commands": "ipc://x"}, "commands"), ({"supervisor_pid": 8}, "supervisor_pid"),
    ({"model_id": ""}, "names no model"),
])
def test_w1_a_hand_off_that_changes_the_spares_identity_is_refused(change, words):
    assert words in handoff_refusal(SPARE_SPEC, given(**change))


def test_w1_a_worker_that_serves_a_model_refuses_a_hand_off():
    assert "already serves" in handoff_refusal(given(), given())


def test_w1_the_hand_off_round_trips_on_the_command_socket():
    codec = p.Codec(p.CommandMsg)
    assert codec.decode(codec.encode(p.TakeModel(spec=given(), cmd=3))) == p.TakeModel(spec=given(), cmd=3)


# -- spares that die: the restart intensity --------------------------------------------------


def test_w1_a_spare_that_keeps_dying_waits_longer_each_time_then_for_the_period():
    scfg = SupervisorConfig(restart_max=3, restart_period=60.0)
    assert next_start([], 100.0, scfg) == 0.0
    assert next_start([100.0], 100.0, scfg) == pytest.approx(101.0)  # 0.5 s * 2^1
    assert next_start([100.0, 101.0], 101.0, scfg) == pytest.approx(103.0)
    assert next_start([100.0, 101.0, 103.0], 103.0, scfg) == pytest.approx(160.0)  # intensity spent
    assert next_start([10.0], 100.0, scfg) == 0.0  # forgotten after the period


# -- W3, W6: the load clock ------------------------------------------------------------------


def test_w3_a_fresh_loads_phases_from_both_sides():
    clock = load_clock.begin(10.0, 10.5, spare=False, estimate=64 * MiB)
    load_clock.hello(clock, started=10.7, now=11.9)
    load_clock.loaded(clock, p.Loaded(weight_bytes=1, seconds=0.2, began=11.95,
                                      phases={"build": 0.01, "read": 0.1, "tokenizer": 0.02}), 12.1)
    load_clock.request_opened(clock, "r1", 12.15)
    load_clock.first_token(clock, 12.2)
    r = load_clock.report(clock, 12.2)
    assert list(r.phases) == ["admit", "spawn", "hello", "build", "read", "tokenizer", "first_token"]
    assert r.phases["admit"] == 0.5 and r.phases["spawn"] == pytest.approx(0.2)
    assert r.phases["hello"] == pytest.approx(1.2) and r.phases["first_token"] == pytest.approx(0.1)
    assert not r.spare and r.elapsed == pytest.approx(2.2)
    assert "a fresh worker" in load_clock.phase_words(r)


def test_w3_a_spares_hand_off_is_its_own_phase():
    clock = load_clock.begin(10.0, 10.1, spare=True, estimate=0)
    load_clock.loaded(clock, p.Loaded(weight_bytes=1, seconds=0.1, began=10.102, phases={"read": 0.05}), 10.2)
    r = load_clock.report(clock, 10.2)
    assert r.spare and r.phases["spare"] == pytest.approx(0.002) and "spawn" not in r.phases


def test_w3_a_request_opened_long_after_the_load_is_not_the_loads():
    clock = load_clock.begin(10.0, 10.0, spare=True, estimate=0)
    load_clock.loaded(clock, p.Loaded(weight_bytes=1, seconds=0.1), 11.0)
    load_clock.request_opened(clock, "late", 11.0 + load_clock.FIRST_REQUEST_WINDOW + 0.1)
    assert clock.first_request == ""


def alive(phase: str, read: int = 0) -> p.Alive:
    return p.Alive(worker_id="w", pid=1, step_seconds=0, loop_seconds=0, steps=0, load_phase=phase,
                   bytes_read=read)


def test_w6_progress_is_said_at_each_new_phase_and_once_a_second_while_reading():
    clock = load_clock.begin(0.0, 0.0, spare=True, estimate=64 * MiB)
    assert load_clock.progress(clock, alive("build"), 0.1)
    assert load_clock.progress(clock, alive("read", 8 * MiB), 0.2)
    assert not load_clock.progress(clock, alive("read", 16 * MiB), 0.5)  # the same phase, soon after
    assert load_clock.progress(clock, alive("read", 40 * MiB), 1.3)
    r = load_clock.report(clock, 1.3)
    assert (r.phase, r.bytes_read, r.estimate_bytes) == ("read", 40 * MiB, 64 * MiB)
    assert load_clock.progress_words(r) == "read: 40 MiB of 64 MiB read, 1.3 s so far"


def test_w6_a_late_heartbeat_never_moves_a_load_back():
    """The hello (DEALER) and the heartbeat (PUSH) are two sockets: an older phase can come last."""
    clock = load_clock.begin(0.0, 0.0, spare=False, estimate=0)
    load_clock.hello(clock, 0.1, 1.0)
    load_clock.progress(clock, alive("hello"), 1.1)
    assert clock.phase == "build"


def test_w1_a_spare_is_spawned_with_no_model_and_takes_its_model_and_draft_at_the_hand_off(tmp_path):
    """A spare's start spec names no model and no draft (the spawn must not read a model it does
    not have); the spec its TakeModel carries names the adopted model's folder and draft."""
    import asyncio

    from supervisor.config import Config, ModelConfig
    from supervisor.wiring.bus import Endpoints
    from supervisor.workers import load_clock
    from supervisor.workers.process import WorkerHandle, worker_spec

    ends = Endpoints(commands="ipc://c", reports="ipc://r", pub="ipc://p", control="ipc://x")

    async def specs() -> tuple[p.WorkerSpec, p.WorkerSpec]:  # a handle's futures need a loop
        handle = WorkerHandle("spare#1", None, 3, 1)
        started = worker_spec(handle, Config(), tmp_path / "ledger", ends)
        handle.move("wait")  # its hello said it is a spare: only then can it take a model
        model = ModelConfig(id="big", path=str(tmp_path / "big"), draft=str(tmp_path / "small"))
        handle.adopt(model, load_clock.begin(0.0, 0.0, spare=True, estimate=0), 0.0)
        return started, worker_spec(handle, Config(), tmp_path / "ledger", ends)

    started, taken = asyncio.run(specs())
    assert (started.model_id, started.model_path, started.draft_path) == ("", "", "")
    assert (taken.model_path, taken.draft_path) == (str(tmp_path / "big"), str(tmp_path / "small"))
    assert (taken.worker_id, taken.slot) == ("spare#1", 3)
