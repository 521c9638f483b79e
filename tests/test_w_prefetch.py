"""SPEC W4 as table tests: which model is read ahead next, and whether now; and the
reading itself, on real files (page cache only, chunk by chunk, stopped between two).
"""

from __future__ import annotations

import os
import threading

import pytest

from shared.sizes import MiB
from supervisor.models.prefetch import CHUNK, Reading, read_ahead
from supervisor.policy.prefetch import Candidate, followers, likely_next, may_prefetch, room


def c(model: str, last_used: float = 0.0, size: int = 100 * MiB) -> Candidate:
    return Candidate(model=model, size=size, last_used=last_used)


# (name, candidates, sequence asked for, expected)
PREDICT_TABLE = [
    ("nothing to read ahead", [], ["a", "b"], None),
    ("alternating a, b with a asked last: b", [c("b", 5.0), c("c", 9.0)], ["a", "b", "a", "b", "a"], "b"),
    ("a pipeline a -> b -> c, b asked last: c", [c("a", 9.0), c("c", 1.0)], ["a", "b", "c", "a", "b"], "c"),
    ("the more frequent follower wins over the more recent",
     [c("b", 1.0), c("c", 9.0)], ["a", "b", "a", "c", "a", "b", "a"], "b"),
    ("equal followers: the more recently used", [c("b", 1.0), c("c", 9.0)], ["a", "b", "a", "c", "a"], "c"),
    ("no follower known: last-used order", [c("b", 3.0), c("c", 7.0)], ["a"], "c"),
    ("no sequence yet: last-used order", [c("b", 3.0), c("c", 7.0)], [], "c"),
    ("never used and never asked for: nothing says it is coming", [c("b"), c("c")], ["a"], None),
    ("asked for (its load failed) counts as used", [c("b"), c("c")], ["b", "a"], "b"),
]


@pytest.mark.parametrize("name,candidates,sequence,expected", PREDICT_TABLE, ids=[t[0] for t in PREDICT_TABLE])
def test_w4_the_model_read_ahead_is_the_one_likely_asked_for_next(name, candidates, sequence, expected):
    assert likely_next(candidates, sequence) == expected


def test_w4_followers_count_what_came_right_after():
    assert followers(["a", "b", "a", "c", "a", "b"], "a") == {"b": 2, "c": 1}
    assert followers(["a", "a", "b"], "a") == {"b": 1}
    assert followers([], "a") == {}


# (name, level, room, size, expected)
WHEN_TABLE = [
    ("ok with room for all of it", "ok", 200 * MiB, 100 * MiB, True),
    ("ok, room for exactly all of it", "ok", 100 * MiB, 100 * MiB, True),
    ("ok, room for part of it only: no", "ok", 99 * MiB, 100 * MiB, False),
    ("soft: never", "soft", 10_000 * MiB, 100 * MiB, False),
    ("hard: never", "hard", 10_000 * MiB, 100 * MiB, False),
    ("size not known yet: no", "ok", 10_000 * MiB, 0, False),
]


@pytest.mark.parametrize("name,level,room_bytes,size,expected", WHEN_TABLE, ids=[t[0] for t in WHEN_TABLE])
def test_w4_prefetch_only_at_ok_and_with_room_for_the_whole_model(name, level, room_bytes, size, expected):
    assert may_prefetch(level=level, room_bytes=room_bytes, size=size) is expected


def test_w4_room_is_the_dynamic_ceiling_above_usage():
    assert room(dynamic=1000, static=5000, usage=400) == 600
    assert room(dynamic=0, static=5000, usage=400) == 4600  # no dynamic term: the static ceiling
    assert room(dynamic=300, static=5000, usage=400) == 0


def _weights(tmp_path, size: int):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(1024) * (size // 1024))
    return path


def test_w4_read_ahead_reads_every_byte_of_the_files(tmp_path):
    path = _weights(tmp_path, 3 * CHUNK + 5 * 1024)
    reading = Reading(model="m", size=path.stat().st_size)
    assert read_ahead([path], reading, lambda: True) == "done"
    assert reading.done == path.stat().st_size


def test_w4_read_ahead_stops_between_two_chunks_when_the_level_leaves_ok(tmp_path):
    """The level is looked at between two chunks: a prefetch stops within one chunk."""
    path = _weights(tmp_path, 4 * CHUNK)
    reading = Reading(model="m", size=path.stat().st_size)
    looks = iter([True, True, False])
    assert read_ahead([path], reading, lambda: next(looks)) == "the memory level left ok"
    assert reading.done == 2 * CHUNK


def test_w4_read_ahead_stops_when_cancelled(tmp_path):
    path = _weights(tmp_path, 2 * CHUNK)
    reading = Reading(model="m", size=path.stat().st_size, cancel=threading.Event())
    reading.cancel.set()
    reading.why = "the memory level left ok"
    assert read_ahead([path], reading, lambda: True) == "the memory level left ok"
    assert reading.done == 0


def test_w4_read_ahead_refuses_what_is_not_a_regular_file(tmp_path):
    """A named pipe called model.safetensors would block a reader for good: refused at open."""
    from shared.modelinfo import FileRefused

    pipe = tmp_path / "model.safetensors"
    os.mkfifo(pipe)
    with pytest.raises(FileRefused):
        read_ahead([pipe], Reading(model="m", size=1), lambda: True)
