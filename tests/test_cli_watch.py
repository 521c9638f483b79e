"""`watch` as a person meets it: it starts with the recent events `status` shows (SPEC S2's
bounded history), `--count` counts them, `--new` skips them; at 80 columns a model's name
stays whole."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from rich.console import Console

from shared import protocol as p
from shared.memory import MemoryReading
from supervisor.cli.watch import _View
from tests.chat_harness import ROOT, Serving, cli_env, run_cli


def test_s2_watch_replays_the_events_status_shows_and_count_counts_them(tmp_path):
    """Before: `watch` started empty while `status` listed four events, and
    `watch --json --topic event --count 5` waited silently for five new ones."""
    with Serving('[supervisor]\nhttp = "127.0.0.1:0"\n', tmp_path) as serving:
        for _ in range(3):
            assert run_cli(serving, "reload").returncode == 0
        kept = json.loads(run_cli(serving, "status", "--json").stdout)["events"]
        assert len(kept) >= 3
        out = run_cli(serving, "watch", "--json", "--topic", "event", "--count", "3", "--timeout", "5s")
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [line["message"]["t"] for line in lines] == [e["t"] for e in kept[:3]]
        assert all(line["replayed"] and line["topic"] == "event" for line in lines)
        quiet = run_cli(serving, "watch", "--json", "--topic", "event", "--new", "--count", "1", "--timeout", "1")
        assert quiet.returncode == 4 and quiet.stdout == "", quiet.stdout  # nothing new happened


def test_s2_watch_gives_a_new_event_once_after_the_replayed_ones(tmp_path):
    with Serving('[supervisor]\nhttp = "127.0.0.1:0"\n', tmp_path) as serving:
        assert run_cli(serving, "reload").returncode == 0
        kept = len(json.loads(run_cli(serving, "status", "--json").stdout)["events"])
        watch = subprocess.Popen([sys.executable, "-m", "supervisor", "watch", "--json", "--topic", "event",
                                  "--count", str(kept + 1), "--timeout", "20", "--runtime-dir",
                                  str(serving.runtime_dir)], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        time.sleep(3.0)  # it has replayed the history and waits on the live stream
        assert run_cli(serving, "reload").returncode == 0
        out, err = watch.communicate(timeout=30)
    lines = [json.loads(line) for line in out.splitlines()]
    assert watch.returncode == 0, err
    assert [line.get("replayed", False) for line in lines] == [True] * kept + [False]
    assert len({line["message"]["t"] for line in lines}) == kept + 1  # none twice


def _render(view: _View, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(view.render(width))
    return console.export_text()


def test_watch_at_80_columns_keeps_every_model_name_whole():
    """Before: names were cut to `demo-…` (rich shrank every column alike)."""
    view = _View()
    names = ["demo-pinned", "demo-medium", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    for n, name in enumerate(names):
        memory = MemoryReading(usage=300 << 20, mlx_active=100 << 20, mlx_pool=20 << 20, cache_bytes=5 << 20)
        view.take(p.Sample(worker_id=f"{name}#{n}", model_id=name, pid=4000 + n, seq=1, t=1.0, memory=memory,
                           running=1, tokens=12345))
        view.take(p.GuardEvent(t=time.time(), kind="load", reason="loaded in 1.2 s, 300 MiB, for a request",
                               worker_id=f"{name}#{n}", model_id=name))
    text = _render(view, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    for n, name in enumerate(names):
        assert f"{name}#{n}" in text  # the workers table
        assert re.search(rf"\bload\s+{re.escape(name)}\s", text)  # the events' model column
    assert "300 MiB" in text and "…" not in text
    wide = _render(view, 160)
    assert "12345" in wide and "4002" in wide  # room enough: pid and tokens too
    assert "waiting for the supervisor's first tick" in _render(_View(), 80)  # nothing yet: the headers alone
