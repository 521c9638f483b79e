"""Invariants of the guard's policy, checked on generated inputs (hypothesis)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.host import HostCounters
from shared.memory import MemoryReading
from shared.sizes import GiB
from supervisor.policy import decisions as d
from supervisor.policy.ceilings import compute_ceilings
from supervisor.policy.pressure import DESTRUCTIVE, tick
from supervisor.policy.replay import replay_lines
from supervisor.policy.snapshot import GuardSettings, PolicyState, Snapshot, WorkerRecord
from supervisor.policy.tiers import TIERS

QUARTER = GiB // 4
sizes = st.integers(0, 96).map(lambda q: q * QUARTER)
maybe_size = st.none() | sizes
STATES = ["starting", "loading", "ready", "busy", "draining", "stopped", "dead", "wedged"]

hosts = st.builds(
    HostCounters, total=st.integers(0, 128).map(lambda g: g * GiB), free=maybe_size,
    inactive=maybe_size, file_backed=maybe_size, active=maybe_size, available=maybe_size,
    compressor=st.booleans(),
)


@st.composite
def worker_lists(draw) -> list[WorkerRecord]:
    out = []
    for i in range(draw(st.integers(0, 7))):
        state = draw(st.sampled_from(STATES))
        serving = state in ("ready", "busy")
        usage = draw(sizes)
        cached = draw(st.integers(0, 8)) * QUARTER
        out.append(WorkerRecord(
            worker=f"w{i}", model=f"m{i}", state=state, pid=draw(st.integers(0, 3)),
            pinned=draw(st.booleans()), marked_for_unload=draw(st.booleans()),
            last_access=float(draw(st.integers(0, 100))),
            running=draw(st.integers(0, 2)) if serving else 0,
            queued=draw(st.integers(0, 1)) if serving else 0,
            memory=MemoryReading(
                usage=usage, footprint=usage + draw(st.integers(0, 4)) * QUARTER,
                mlx_pool=draw(st.integers(0, 16)) * QUARTER, cache_bytes=cached,
                cache_releasable=draw(st.integers(0, 8)) * QUARTER if cached else 0,
            ),
            gpu_bytes=draw(st.integers(0, 2)) * QUARTER,
            max_concurrency=draw(st.integers(1, 4)), concurrency=draw(st.integers(0, 4)),
            ttl=draw(st.none() | st.floats(0, 200)),
        ))
    return out


guards = st.builds(
    GuardSettings, enabled=st.booleans(), tier=st.sampled_from(TIERS),  # T2: a name is normalised where it enters
    custom_ceiling=st.integers(0, 64).map(lambda g: g * GiB),
    soft_threshold=st.sampled_from([None, 0.7, 0.8, 0.85]),
    hard_threshold=st.sampled_from([None, 0.9, 0.95, 0.99]),
    idle_timeout=st.sampled_from([0.0, 30.0]), hot_cache_max=st.sampled_from([0, GiB, 4 * GiB]),
    pressure_reclaim_disabled=st.booleans(),
)
states = st.builds(
    PolicyState, level=st.sampled_from(["ok", "soft", "hard"]),
    over_ceiling_ticks=st.integers(0, 3), grace_ticks=st.integers(0, 6),
    admission_paused=st.booleans(), last_total=st.sampled_from([0, 32 * GiB]),
)
snapshots = st.builds(
    Snapshot, now=st.floats(100, 200), guard=guards, host=st.none() | hosts,
    supervisor_footprint=st.integers(0, 4).map(lambda q: q * QUARTER),
    gpu_cap_raw=st.sampled_from([0, 8 * GiB, 24 * GiB]), recheck=st.booleans(),
    workers=worker_lists(), state=states,
)


@given(host=hosts, own=sizes, own_gpu=sizes, gpu_cap_raw=sizes, tier=st.sampled_from(TIERS),
       custom=st.integers(0, 64).map(lambda g: g * GiB))
def test_c5_c6_ceiling_never_above_a_candidate_and_binding_names_the_smallest(
        host, own, own_gpu, gpu_cap_raw, tier, custom):
    c = compute_ceilings(tier=tier, total=host.total, host=host, own=own, own_gpu=min(own, own_gpu),
                         gpu_cap_raw=gpu_cap_raw, custom_ceiling=custom)
    candidates = [(name, v) for name, v in
                  (("static", c.static), ("dynamic", c.dynamic), ("gpu_cap", c.gpu_cap)) if v > 0]
    assert c.ceiling > 0
    assert all(c.ceiling <= v for _, v in candidates)
    assert c.ceiling == min(v for _, v in candidates)
    assert c.binding == next(name for name, v in candidates if v == c.ceiling)
    assert c.soft <= c.ceiling and c.hard <= c.ceiling  # C11: fractions of the ceiling


@given(host=hosts, own=sizes, extra=st.integers(1, 64).map(lambda q: q * QUARTER),
       tier=st.sampled_from(["safe", "balanced", "aggressive"]))
def test_c2_more_free_memory_never_lowers_the_dynamic_ceiling(host, own, extra, tier):
    def dynamic(h):
        return compute_ceilings(tier=tier, total=h.total, host=h, own=own).dynamic

    base = dynamic(host)
    if host.free is not None:
        assert dynamic(msgspec.structs.replace(host, free=host.free + extra)) >= base
    elif host.available is not None:
        assert dynamic(msgspec.structs.replace(host, available=host.available + extra)) >= base
    if host.free is not None:
        more_inactive = (host.inactive or 0) + extra
        assert dynamic(msgspec.structs.replace(host, inactive=more_inactive)) >= base


@given(snapshots)
def test_p6_no_pressure_decision_ever_stops_a_pinned_model(s):
    """Pinned means "do not unload": a pinned model is only ever aborted (P6
    step 5), never stopped or marked, whatever the pressure."""
    pinned = {w.worker for w in s.workers if w.pinned}
    for x in tick(s).decisions:
        if isinstance(x, (d.Stop, d.MarkForUnload, d.ExpireTTL)):
            assert x.worker not in pinned


@given(snapshots)
def test_p6_eviction_stops_as_soon_as_projected_usage_is_at_or_below_soft(s):
    """Every Stop is decided while projected usage is still above soft: no model
    is stopped for memory that is not needed."""
    r = tick(s)
    usage = {w.worker: w.usage for w in s.workers}
    marked = {w.worker for w in s.workers if w.marked_for_unload}
    draining = sum(w.usage for w in s.workers if w.state == "draining")
    assert r.draining_credited in (0, draining)
    projected = r.usage - r.draining_credited
    for x in r.decisions:
        if isinstance(x, d.ShrinkHotCache):
            record = next(w for w in s.workers if w.worker == x.worker)
            projected -= record.memory.cache_bytes - x.target_bytes
        elif isinstance(x, d.Stop):
            if x.worker not in marked:  # P6.3: a marked worker goes once drained, whatever the level
                assert projected > r.ceilings.soft
            projected -= usage[x.worker]
        elif isinstance(x, d.ExpireTTL):
            projected -= usage[x.worker]
    assert projected == r.projected_usage


@given(snapshots)
def test_p2_emergency_never_fires_below_the_ceiling(s):
    r = tick(s)
    if r.emergency:
        assert r.ceilings.ceiling > 0 and r.usage >= r.ceilings.ceiling


@given(snapshots)
def test_guard_off_makes_no_destructive_decision(s):
    off = msgspec.structs.replace(s, guard=msgspec.structs.replace(s.guard, enabled=False))
    r = tick(off)
    assert r.level == "ok" and not r.emergency
    assert not [x for x in r.decisions if isinstance(x, (*DESTRUCTIVE, d.PauseAdmission))]


@given(snapshots)
def test_decisions_only_name_live_workers_once_per_kind(s):
    live = {w.worker for w in s.workers if w.state not in ("stopped", "dead", "failed")}
    seen = set()
    for x in tick(s).decisions:
        if hasattr(x, "worker"):
            assert x.worker in live
            key = (type(x), x.worker)
            assert key not in seen
            seen.add(key)


@settings(max_examples=50)
@given(st.lists(snapshots, min_size=1, max_size=6))
def test_replaying_a_trace_twice_gives_the_same_decisions(trace):
    lines = [msgspec.json.encode(s) for s in trace]
    first = [msgspec.json.encode(t) for t in replay_lines(lines)]
    second = [msgspec.json.encode(t) for t in replay_lines(lines)]
    assert first == second
    for s, raw in zip(trace, lines, strict=True):
        assert msgspec.json.decode(raw, type=Snapshot) == s
