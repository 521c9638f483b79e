"""The supervisor's side of the prompt cache (SPEC H2, C12, M1, S1): caps, defaults, reporting."""

from __future__ import annotations

import msgspec

from shared.memory import MemoryReading
from shared.sizes import GiB, MiB
from supervisor.config import guard_settings
from supervisor.config_file import parse_config
from supervisor.http.openai_types import PromptTokensDetails, Usage
from supervisor.policy import decisions as d
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.status import build_status
from tests.prompt_cache_harness import GUARD, HOST, worker


def caps(result) -> dict[str, int]:
    return {x.worker: x.limits.cache_cap for x in d.per_worker(result.decisions) if isinstance(x, d.ApplyLimits)}


def test_h2_each_live_worker_gets_an_equal_share_recomputed_as_workers_go():
    """The budget in force is min(3 GiB, soft 8 GiB // 4) = 2 GiB (H2, 2026-12-01)."""
    three = tick(Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[worker("a"), worker("bb"), worker("ccc")]))
    assert three.ceilings.hot_cache_budget == 2 * GiB
    assert caps(three) == {"a": 2 * GiB // 3, "bb": 2 * GiB // 3, "ccc": 2 * GiB // 3}
    two = tick(Snapshot(now=2.0, guard=GUARD, host=HOST, workers=[worker("a"), worker("bb")],
                        state=three.state))
    assert caps(two) == {"a": GiB, "bb": GiB}
    leaving = tick(Snapshot(now=3.0, guard=GUARD, host=HOST, workers=[worker("a"), record_of("bb", "draining")],
                            state=two.state))
    assert caps(leaving)["a"] == 2 * GiB  # a draining worker keeps no share


def record_of(name: str, state) -> WorkerRecord:
    return msgspec.structs.replace(worker(name), state=state)


SMALL = GuardSettings(tier="custom", custom_ceiling=511 * MiB, hot_cache_max=GiB)  # the default budget


def limits_of(result) -> dict[str, object]:
    return {x.worker: x.limits for x in d.per_worker(result.decisions) if isinstance(x, d.ApplyLimits)}


def small(name: str, usage: int, cached: int = 0, releasable: int | None = None) -> WorkerRecord:
    return WorkerRecord(worker=name, model=f"m-{name}", pid=100 + len(name), memory=MemoryReading(
        usage=usage, footprint=usage, cache_bytes=cached,
        cache_releasable=cached if releasable is None else releasable))


def test_c12_small_custom_ceiling_with_the_default_budget_keeps_real_limits():
    """Under a 511 MiB custom ceiling the default 1 GiB budget took every
    worker's limits to 1 byte: no watermark sample woke the guard (a 1 GiB/s drill
    went 194.6 % over) and every prompt was refused with "the limit is 1 B"."""
    result = tick(Snapshot(now=1.0, guard=SMALL, host=HOST, workers=[small("a", 200 * MiB), small("bb", 200 * MiB)]))
    c = result.ceilings
    assert c.hot_cache_reserved == 0 and c.hot_cache_budget == c.soft // 4
    for limits in limits_of(result).values():
        assert limits.hard_limit == c.ceiling == 511 * MiB
        assert limits.abort_limit == c.abort_limit
        assert (limits.soft_limit, limits.hard_watermark) == (c.soft, c.hard)  # where the guard wakes
        assert limits.cache_cap == c.soft // 4 // 2


def test_c12_a_workers_limits_subtract_only_the_other_workers_caches():
    workers = [small("a", 150 * MiB, 30 * MiB), small("bb", 150 * MiB, 10 * MiB), small("ccc", 150 * MiB)]
    result = tick(Snapshot(now=1.0, guard=SMALL, host=HOST, workers=workers))
    hard = {k: v.hard_limit for k, v in limits_of(result).items()}
    assert result.ceilings.hot_cache_reserved == 40 * MiB
    assert hard == {"a": 511 * MiB - 10 * MiB, "bb": 511 * MiB - 30 * MiB, "ccc": 511 * MiB - 40 * MiB}
    quiet = tick(Snapshot(now=2.0, guard=SMALL, host=HOST, workers=workers, state=result.state))
    assert limits_of(quiet) == {}  # nothing changed: nothing re-sent
    workers[1] = small("bb", 150 * MiB, 20 * MiB)
    grown = tick(Snapshot(now=3.0, guard=SMALL, host=HOST, workers=workers, state=quiet.state))
    assert {k: v.hard_limit for k, v in limits_of(grown).items()} == {
        "a": 511 * MiB - 20 * MiB, "ccc": 511 * MiB - 50 * MiB}  # bb's own limits did not change


def test_c12_caches_that_leave_no_room_are_dropped_never_a_one_byte_limit():
    """The ceiling lowered under full caches: ceiling - caches <= usage, so no
    worker could run a step under its limits. The least recently used entries
    no request uses give way (H3) until there is room, and the limits
    subtract what the others keep."""
    guard = GuardSettings(tier="custom", custom_ceiling=GiB, hot_cache_max=GiB)
    workers = [small("a", 450 * MiB, 300 * MiB, releasable=250 * MiB), small("bb", 450 * MiB, 300 * MiB)]
    result = tick(Snapshot(now=1.0, guard=guard, host=HOST, workers=workers))
    assert result.level == "ok"
    shrinks = {x.worker: x.target_bytes for x in result.decisions if isinstance(x, d.ShrinkHotCache)}
    need = (600 * MiB + 900 * MiB - GiB) // 2 + 1  # dropping x frees it from usage and caches alike
    assert shrinks == {"a": 300 * MiB - need}
    hard = {k: v.hard_limit for k, v in limits_of(result).items()}
    assert hard == {"a": GiB - 300 * MiB, "bb": GiB - (300 * MiB - need)}
    after = 900 * MiB - need  # the group's usage once the entries have gone
    assert min(hard.values()) > after  # room for the next step, never 1 byte
    assert result.projected_usage == after


def test_h2_no_budget_is_no_prompt_cache():
    guard = msgspec.structs.replace(GUARD, hot_cache_max=0)
    assert caps(tick(Snapshot(now=1.0, guard=guard, host=HOST, workers=[worker("a")]))) == {"a": 0}


def test_m1_pool_max_and_m2_residency_ride_in_the_limits_only_when_wiring_is_asked_for():
    """M2 (2026-12-05): no residency ceiling (nothing wired) unless `[guard] wire_weights` opts in."""
    for wire, expected in ((False, lambda c: 0), (True, lambda c: c.residency_ceiling)):
        guard = msgspec.structs.replace(GUARD, wire_weights=wire)
        result = tick(Snapshot(now=1.0, guard=guard, host=HOST, workers=[worker("a")]))
        limits = next(x.limits for x in d.per_worker(result.decisions) if isinstance(x, d.ApplyLimits))
        assert limits.pool_max == 2 * GiB
        assert limits.residency == expected(result.ceilings) and result.ceilings.residency_ceiling > 0


def test_c12_reservation_follows_the_measured_cache_bytes():
    result = tick(Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[worker("a", 600 * MiB)]))
    assert result.ceilings.hot_cache_reserved == 600 * MiB  # C12 2026-12-01: no slack for growth


def test_s1_status_shows_each_cache_and_the_group_total_against_the_budget():
    s = Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[worker("a", 100 * MiB), worker("bb", 50 * MiB)])
    status = build_status(s, tick(s))
    assert (status.hot_cache_used, status.hot_cache_max) == (150 * MiB, 3 * GiB)
    assert [w.cache_bytes for w in status.workers] == [100 * MiB, 50 * MiB]


def test_config_defaults_one_gib_of_prompt_cache_and_a_two_gib_pool():
    config = parse_config("")
    assert (config.guard.hot_cache_max, config.guard.pool_max) == (GiB, 2 * GiB)
    assert guard_settings(config).pool_max == 2 * GiB
    assert parse_config('[guard]\nhot_cache_max = 0\npool_max = "512MiB"').guard.pool_max == 512 * MiB


def test_h1_usage_reports_cached_prompt_tokens_as_openai_does():
    usage = Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=8))
    body = msgspec.json.decode(msgspec.json.encode(usage))
    assert body["prompt_tokens_details"] == {"cached_tokens": 8, "disk_cached_tokens": 0}  # H5: the disk part


def test_p4_the_pool_threshold_is_pool_max():
    """M1 gives MLX `pool_max` as its cache limit; P4 must call the same pool fat."""
    guard = msgspec.structs.replace(GUARD, pool_max=GiB)
    fat = WorkerRecord(worker="a", model="m-a", pid=1, state="busy", running=1, memory=MemoryReading(usage=int(8.5 * GiB), footprint=int(8.5 * GiB), mlx_pool=int(1.5 * GiB)))
    result = tick(Snapshot(now=1.0, guard=guard, host=HOST, workers=[fat]))
    assert result.level == "soft" and [x.worker for x in result.decisions if isinstance(x, d.ReclaimPool)] == ["a"]
    result = tick(Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[fat]))  # 2 GiB: not fat
    assert not [x for x in result.decisions if isinstance(x, d.ReclaimPool)]


def test_s1_status_command_shows_the_cache_per_worker_and_against_the_budget():
    from supervisor.cli.status import render
    from supervisor.policy.status import ModelInfo, ServerStatus

    s = Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[worker("a", 100 * MiB)])
    status = ServerStatus(pid=1, uptime=1.0, runtime_dir="rt", pub="ipc://pub", http="", guard=build_status(s, tick(s)),
                          models=[ModelInfo(id="m-a", path="/m", pinned=False, state="ready", worker="a")],
                          events=[], malformed_frames=0, counters={})
    text = render(status)
    assert "prompt cache 100 MiB of 2 GiB budget in force (hot_cache_max 3 GiB, at most a quarter of soft)" in text
    row = next(line for line in text.splitlines() if line.startswith(" m-a"))
    assert "100 MiB" in row


def test_h2_watch_shows_each_cache_and_the_group_total_against_the_budget():
    from rich.console import Console

    from shared import protocol as p
    from supervisor.cli.watch import _View

    view = _View()
    view.take(p.CeilingMsg(t=0.0, enabled=True, tier="custom", ceiling=10 * GiB, static=10 * GiB, dynamic=0,
                           gpu_cap=0, binding="static", soft_bytes=9 * GiB, hard_bytes=9 * GiB, reserve=0,
                           hot_cache_max=GiB, hot_cache_reserved=600 * MiB))
    for name, cached in (("a#1", 100 * MiB), ("b#1", 50 * MiB)):
        view.take(p.Sample(worker_id=name, model_id=name[0], pid=1, seq=1, t=0.0, memory=MemoryReading(usage=GiB, cache_bytes=cached)))
    console = Console(width=200, record=True)
    console.print(view.render())
    text = console.export_text()
    assert "prompt cache 150 MiB / 1 GiB budget" in text
    assert "100 MiB" in text and "50 MiB" in text
