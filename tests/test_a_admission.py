"""SPEC A1-A4 (admission of a model load) and G1's eviction for a prefill.

Same guard as the P tables (tests/pressure_harness.py): custom tier, 10 GiB ceiling, soft 8 GiB
(the A1 evict target), on a 64 GiB machine (static 62 GiB).
"""

from __future__ import annotations

import msgspec
import pytest

from shared.host import HostCounters
from shared.sizes import GiB, MiB
from supervisor.policy.admission import (
    INSUFFICIENT_MEMORY,
    MODEL_TOO_LARGE,
    admit_load,
    prefill_room,
)
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from tests.records import record

GUARD = GuardSettings(tier="custom", custom_ceiling=10 * GiB, soft_threshold=0.8, hard_threshold=0.9)
HOST = HostCounters(total=64 * GiB)


def w(name: str, gib: float, **kw) -> WorkerRecord:
    size = int(gib * GiB)
    kw.setdefault("model", f"m-{name}")
    return record(worker=name, usage=size, footprint=size, **kw)


def snap(*workers: WorkerRecord, guard: GuardSettings = GUARD, host=HOST, **kw) -> Snapshot:
    return Snapshot(now=1000.0, guard=guard, host=host, workers=list(workers), **kw)


def test_a1_a2_evicts_lru_idle_down_to_the_soft_target():
    """Admitting into the soft..ceiling band kept both models resident through
    the load and pushed the machine into hard pressure and swap."""
    s = snap(w("old", 2.0, last_access=1), w("mid", 2.0, last_access=2), w("new", 2.0, last_access=3))
    v = admit_load(s, "big", 4 * GiB)
    # 6 + 4 = 10 > 8: stop "old" -> 8 <= 8
    assert v.admitted and v.evict == ["old"]
    assert v.target == int(10 * GiB * 0.8) and v.ceiling == 10 * GiB


def test_a2_never_evicts_pinned_busy_or_the_model_itself():
    s = snap(w("pinned", 2.0, pinned=True, last_access=0), w("busy", 2.0, state="busy", running=1),
             w("self", 1.0, model="big"), w("queued", 1.0, queued=1), w("idle", 1.0, last_access=5))
    v = admit_load(s, "big", 3 * GiB)
    assert v.evict == ["idle"]


def test_a3_admit_when_it_fits_under_the_ceiling_even_above_target():
    v = admit_load(snap(w("busy", 5.0, state="busy", running=1)), "m", 4 * GiB)
    assert v.admitted and v.evict == [] and v.error == ""


def test_a3_model_too_large_names_binding_and_remedy():
    v = admit_load(snap(w("idle", 1.0)), "huge", 11 * GiB)
    assert not v.admitted and v.error == MODEL_TOO_LARGE
    assert v.binding == "dynamic" and "raise the custom ceiling" in v.remedy
    assert "huge" in v.message and "11 GiB" in v.message
    assert v.evict == []  # a refused load destroys nothing


def test_a3_insufficient_memory_after_every_idle_model():
    s = snap(w("busy", 6.0, state="busy", running=1), w("idle", 1.0))
    v = admit_load(s, "m", 5 * GiB)
    assert not v.admitted and v.error == INSUFFICIENT_MEMORY and v.evict == []
    assert "4 GiB" in v.message  # free after stopping "idle": 10 - 6


def test_a3_static_binding_remedy_and_gpu_cap_binding():
    static = snap(guard=GuardSettings(tier="balanced"), host=HostCounters(total=16 * GiB))
    v = admit_load(static, "m", 14 * GiB)
    assert v.binding == "static" and "tier" in v.remedy
    gpu = snap(guard=GUARD, gpu_cap_raw=6 * GiB)
    v = admit_load(gpu, "m", 7 * GiB)
    assert v.binding == "gpu_cap" and "iogpu.wired_limit_mb" in v.remedy


def test_c1_a3_every_load_is_refused_when_the_tier_reserves_the_whole_machine():
    s = snap(guard=GuardSettings(tier="safe"), host=HostCounters(total=4 * GiB, free=3 * GiB))
    v = admit_load(s, "tiny", 1 * MiB)
    assert not v.admitted and v.error == MODEL_TOO_LARGE
    assert "reserves 6 GiB but the machine has only 4 GiB" in v.message


def test_a4_guard_off_evicts_to_fit_under_static_and_never_refuses():
    """With the guard off, loads must still evict idle models: an overcommitted
    second model once thrashed the whole machine."""
    off = GuardSettings(enabled=False, tier="custom")
    s = snap(w("a", 30.0, last_access=1), w("b", 25.0, last_access=2), guard=off)
    v = admit_load(s, "m", 10 * GiB)
    assert v.admitted and v.ceiling == 62 * GiB and v.binding == "static"
    assert v.evict == ["a"]  # 55 + 10 > int(62 * 0.9); without "a": 35
    huge = admit_load(s, "m", 100 * GiB)
    assert huge.admitted and huge.error == ""


def test_a2_draining_workers_count_as_gone_and_are_waited_for():
    s = snap(w("gone", 4.0, state="draining"), w("idle", 2.0))
    v = admit_load(s, "m", 6 * GiB)
    assert v.admitted and v.evict == [] and v.wait_for == ["gone"]


def test_g1_need_bytes_is_the_shortfall_and_victims_cover_it():
    """G1: `need_bytes` is usage + peak - hard limit. Read as the whole extra
    (usage + need <= limit), a 1.14 GiB shortfall on a 10 GiB ceiling with the
    group at 4 GiB evicted nothing and the retry was rejected."""
    s = snap(w("me", 1.0, state="busy", running=1), w("old", 3.0, last_access=1))
    assert prefill_room(s, "me", int(1.14 * GiB)).stop == ["old"]


def test_g1_evicts_idle_lru_until_their_usage_covers_the_shortfall():
    s = snap(w("me", 5.0, state="busy", running=1), w("old", 2.0, last_access=1),
             w("new", 2.0, last_access=2))
    assert prefill_room(s, "me", 2 * GiB).stop == ["old"]
    assert prefill_room(s, "me", int(2.5 * GiB)).stop == ["old", "new"]
    assert prefill_room(s, "me", 1).stop == ["old"]
    assert prefill_room(s, "me", 0).stop == []


def test_g1_never_the_asking_worker_pinned_or_busy():
    s = snap(w("me", 1.0, last_access=0), w("pinned", 2.0, pinned=True, last_access=0),
             w("busy", 2.0, state="busy", running=1), w("idle", 1.0, last_access=9))
    assert prefill_room(s, "me", GiB).stop == ["idle"]


def test_g1_evicts_nothing_when_it_cannot_fit_anyway_or_guard_off():
    s = snap(w("me", 5.0, state="busy", running=1), w("old", 2.0))
    assert prefill_room(s, "me", 3 * GiB).stop == []
    off = msgspec.structs.replace(s, guard=GuardSettings(enabled=False))
    assert prefill_room(off, "me", 1 * GiB).stop == []


def test_g1_a_stop_under_way_counts_as_room_and_is_waited_for_before_any_eviction():
    """A swap had drained a spare (and the leaving model) when that model's worker asked for
    room: with no idle model to stop, the answer was "nothing" and the request was refused,
    though the spare's memory came back 0.1 s later. A draining worker with nothing left to
    finish is room on its way: counted first, waited for, and only the rest is evicted."""
    s = snap(w("me", 1.0, state="busy", running=1), w("spare", 0.5, model="", state="draining"),
             w("old", 2.0, last_access=1))
    room = prefill_room(s, "me", int(0.4 * GiB))
    assert room.await_exit == ["spare"] and room.stop == [] and room.made
    room = prefill_room(s, "me", 1 * GiB)  # the spare's half is not enough: "old" covers the rest
    assert room.await_exit == ["spare"] and room.stop == ["old"]


def test_g1_a_stop_still_finishing_requests_is_not_counted_and_the_asker_never_is():
    """A draining worker still running a request may take as long as the request does; the
    asking worker's own memory never makes room for itself."""
    s = snap(w("me", 1.0, state="draining", running=1), w("busy", 0.5, state="draining", running=1))
    assert not prefill_room(s, "me", int(0.4 * GiB)).made
    assert not prefill_room(s, "busy", int(0.4 * GiB)).made  # "me" runs a request: not room either


@pytest.mark.parametrize("size", [0, 1, 4 * GiB])
def test_a_verdict_round_trips_json(size):
    v = admit_load(snap(w("a", 1.0)), "m", size)
    assert msgspec.json.decode(msgspec.json.encode(v), type=type(v)) == v


def test_g1_d_a_device_shortfall_is_covered_by_the_victims_device_bytes():
    """On a discrete device a prefill's peak is device memory (SPEC D): the shortfall is in
    the device pool, so the idle victims' device bytes cover it, not their host usage (on
    CUDA a worker's host usage is its footprint alone), and one holding nothing there is
    passed over."""
    s = snap(w("me", 0.5, state="busy", running=1, device_bytes=20 * GiB),
             w("cpu", 3.0, last_access=0),  # idle, 3 GiB of host RAM, nothing on the device
             w("old", 0.5, last_access=1, device_bytes=8 * GiB), w("new", 0.5, last_access=2, device_bytes=8 * GiB),
             device_total=80 * GiB, device_free=40 * GiB)
    assert prefill_room(s, "me", 6 * GiB, pool="device").stop == ["old"]
    assert prefill_room(s, "me", 12 * GiB, pool="device").stop == ["old", "new"]
    assert prefill_room(s, "me", 17 * GiB, pool="device").stop == []  # every idle model would not cover it
    assert prefill_room(s, "me", 2 * GiB).stop == ["cpu"]  # the host pool: host usage, as before
    no_device = msgspec.structs.replace(s, device_total=0)
    assert prefill_room(no_device, "me", 6 * GiB, pool="device").stop == []
