"""The lab's record and picture without workers: `replay --plot` of a recorded
trace, and the lab command's refusal of an unknown scenario."""

from __future__ import annotations

from pathlib import Path

from supervisor.cli import main
from supervisor.lab.timeline import timeline_from_trace

EPISODE = Path(__file__).parent / "fixtures" / "traces" / "pressure_episode.jsonl"


def test_a_trace_becomes_a_timeline_with_the_policys_decisions():
    with open(EPISODE, "rb") as lines:
        t = timeline_from_trace(lines, "episode")
    assert len(t.points) == 9
    assert [pt.level for pt in t.points][2:6] == ["hard"] * 4
    assert [m.label for m in t.decisions("stop")] == ["m-a"]
    assert [m.label for m in t.decisions("expire_ttl")] == ["m-b"]
    assert t.points[0].ceiling > t.points[0].hard > t.points[0].soft > 0


def test_replay_plot_draws_a_png(tmp_path, capsys):
    out = tmp_path / "episode.png"
    assert main(["replay", str(EPISODE), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_lab_refuses_an_unknown_scenario_by_name(capsys):
    assert main(["lab", "no-such-scenario"]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario" in err and "soft-two-idle" in err
