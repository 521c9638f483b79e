"""`python -m supervisor replay`: recorded policy inputs in, decisions out.

tests/fixtures/traces/pressure_episode.jsonl is one pressure episode on the
custom 10 GiB guard (soft 8, hard 9 GiB): quiet, busy, hard with a fat pool
(P4 grace), a recheck, an eviction (P6), the victim draining, recovery, and a
TTL expiry (P10).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from supervisor.cli import main
from supervisor.policy.replay import BadLine, ReplayTick, replay_lines
from supervisor.policy.snapshot import PolicyState, Snapshot

TRACES = Path(__file__).parent / "fixtures" / "traces"
EPISODE = TRACES / "pressure_episode.jsonl"
BAD = TRACES / "bad_lines.jsonl"


def _replay(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = main(["replay", *argv])
    captured = capsys.readouterr()
    return code, [json.loads(line) for line in captured.out.splitlines()], captured.err


def _actions(tick: dict) -> list[tuple[str, str]]:
    return [(x["kind"], x.get("worker", "")) for x in tick["decisions"]
            if x["kind"] not in ("set_limits", "set_concurrency")]


def test_replay_pressure_episode_decisions(capsys):
    code, ticks, err = _replay(capsys, str(EPISODE))
    assert code == 0 and err == ""
    assert [t["line"] for t in ticks] == list(range(1, 10))
    assert [t["level"] for t in ticks] == ["ok", "ok", "hard", "hard", "hard", "hard", "ok", "ok", "ok"]
    assert _actions(ticks[2]) == [("level_changed", ""), ("pause_admission", ""), ("reclaim", "b")]
    assert _actions(ticks[3]) == [("reclaim", "b")]           # recheck: grace, not counted
    assert _actions(ticks[4]) == [("stop", "a")]              # P6 step 2
    assert _actions(ticks[5]) == []                           # a draining: no second victim
    assert _actions(ticks[6]) == [("level_changed", ""), ("resume_admission", "")]
    assert _actions(ticks[8]) == [("expire_ttl", "b")]        # P10
    assert [t["next_interval"] for t in ticks] == [10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0, 10.0]


def test_replay_twice_gives_the_same_output(capsys):
    first = _replay(capsys, str(EPISODE))
    second = _replay(capsys, str(EPISODE))
    assert first == second


def test_replay_bad_lines_are_reported_with_their_number_and_the_rest_replays(capsys):
    code, ticks, err = _replay(capsys, str(BAD))
    assert code == 1
    assert [t["line"] for t in ticks] == [1, 2, 6]  # line 3 is blank, 4 and 5 are bad
    assert f"{BAD}:4: not a policy snapshot: JSON is malformed" in err
    assert f"{BAD}:5: not a policy snapshot: Expected `int`, got `str` - at `$.workers[1].memory.usage`" in err
    assert "2 bad line(s) skipped" in err
    assert "Traceback" not in err


def test_replay_missing_file_is_a_clear_error(capsys, tmp_path):
    code, ticks, err = _replay(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 2 and ticks == [] and "cannot read" in err


def test_replay_chains_state_by_default_and_can_use_the_recorded_one():
    """The fixture's lines all carry an empty recorded state. Chained, line 4
    sees the grace tick of line 3 and the pause already decided; recorded,
    every line starts from scratch and pauses admission again."""
    lines = EPISODE.read_bytes().splitlines()
    chained = [t for t in replay_lines(lines) if isinstance(t, ReplayTick)]
    recorded = [t for t in replay_lines(lines, chained=False) if isinstance(t, ReplayTick)]
    paused = lambda ticks: [t.line for t in ticks if any(  # noqa: E731
        x.__struct_config__.tag == "pause_admission" for x in t.decisions)]
    assert paused(chained) == [3]
    assert paused(recorded) == [3, 4, 5, 6]


def test_replay_recorded_state_is_used_when_asked():
    first = msgspec.json.decode(EPISODE.read_bytes().splitlines()[2], type=Snapshot)
    state = PolicyState(level="hard", admission_paused=True, grace_ticks=5)
    line = msgspec.json.encode(msgspec.structs.replace(first, state=state))
    (tick,) = replay_lines([line], chained=False)
    kinds = [x.__struct_config__.tag for x in tick.decisions]
    assert "pause_admission" not in kinds and "level_changed" not in kinds
    assert "stop" in kinds  # the grace budget was spent: P6 acts at once


def test_replay_bad_line_yields_badline_not_exception():
    (bad,) = replay_lines([b'{"now": "soon"}'])
    assert isinstance(bad, BadLine) and bad.line == 1 and "$.now" in bad.error


def test_snapshot_round_trips_through_json():
    for raw in EPISODE.read_bytes().splitlines():
        snap = msgspec.json.decode(raw, type=Snapshot)
        assert msgspec.json.decode(msgspec.json.encode(snap), type=Snapshot) == snap


def test_replay_help_documents_how_state_is_carried(capsys):
    try:
        main(["replay", "--help"])
    except SystemExit as stop:
        assert stop.code == 0
    text = capsys.readouterr().out
    assert "chained like the live enforcer" in text and "--recorded-state" in text


def test_replay_reads_stdin(capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(EPISODE.read_bytes())))
    code, ticks, _ = _replay(capsys, "-")
    assert code == 0 and len(ticks) == 9
