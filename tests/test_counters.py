"""The supervisor's counters (supervisor.guard.counters): named fields, listed as /status lists them."""

import msgspec
import pytest

from supervisor.guard.counters import SupervisorCounters


def test_status_lists_the_counters_that_counted_by_name():
    counters = SupervisorCounters()
    counters.spawned += 2
    counters.prefetch_bytes += 4096
    assert counters.as_dict() == {"spawned": 2, "prefetch_bytes": 4096}


def test_a_misspelt_counter_is_refused_not_counted_as_a_new_key():
    counters = SupervisorCounters()
    with pytest.raises(AttributeError):
        counters.spawnd += 1  # type: ignore[attr-defined]  # mypy says so first
    assert counters.as_dict() == {}


def test_every_counter_the_metrics_read_is_a_field():
    """/metrics reads these by name (supervisor/http/metrics.py): each is a counter of the supervisor."""
    fields = set(SupervisorCounters.__struct_fields__)
    assert {"spawned", "exits", "respawns", "wedged", "samples"} <= fields
    assert all(isinstance(v, int) for v in msgspec.structs.asdict(SupervisorCounters()).values())
