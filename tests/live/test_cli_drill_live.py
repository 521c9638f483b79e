"""The fire drill as a person meets it (`serve --allow-drills`, `drill`, `status`): its start
and its end are one event each, in human units."""

from __future__ import annotations

import json
import time

import pytest

from tests.chat_harness import Serving, run_cli

pytestmark = pytest.mark.slow


def _drill_events(serving: Serving) -> list[str]:
    events = json.loads(run_cli(serving, "status", "--json").stdout)["events"]
    return [e["reason"] for e in events if e["kind"] == "drill"]


def test_s2_a_drill_is_one_event_at_its_start_and_one_at_its_end_in_human_units(tiny_models, tmp_path):
    """Before: two events at the start (the supervisor's order and the worker's start), both in
    bytes ("fire drill: 67108864 B/s up to 134217728 B")."""
    toml = (f'[supervisor]\nhttp = "127.0.0.1:0"\nallow_drills = true\n'
            f'[[models]]\nid = "a"\npath = "{tiny_models.a}"\npinned = true\n')
    with Serving(toml, tmp_path) as serving:
        deadline = time.monotonic() + 60
        while json.loads(run_cli(serving, "status", "--json").stdout)["models"][0]["state"] != "ready":
            assert time.monotonic() < deadline, "the pinned model did not load"
            time.sleep(0.5)
        out = run_cli(serving, "drill", "a", "--rate", "64MiB/s", "--to", "32MiB")
        assert out.returncode == 0, out.stderr
        time.sleep(1.5)  # it has held its 32 MiB for a while
        assert run_cli(serving, "drill", "a", "--stop").returncode == 0
        deadline = time.monotonic() + 10
        while len(_drill_events(serving)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _drill_events(serving) == ["drill started: 64 MiB/s up to 32 MiB",
                                          "drill released 32 MiB: stopped by command"]
