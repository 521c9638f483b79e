"""SPEC W4 through a real supervisor: the weights of the model likely asked for next are read
ahead into the page cache while the level is ok, never counted as usage, and never while
the level is not ok (a prefetch in progress stops at soft)."""

from __future__ import annotations

import asyncio
import json
import os
import struct

import pytest

from shared.sizes import GiB
from tests.arbiter_harness import Running
from tests.swap_harness import (
    SIZE,
    ask,
    events,
    make_pair,
    pair_config,
    set_ceiling,
    until,
    usage,
    worker_usage,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


async def alternate(arb) -> None:
    """a, b, a: b is what came after a."""
    for model in ("a", "b", "a"):
        assert (await ask(arb, model)).outcome == "ok"


def read_ahead(arb, model: str, how: str) -> list:
    return [e for e in events(arb, "prefetch", model) if e.reason.startswith(how)]


def test_w4_the_model_likely_asked_for_next_is_read_ahead_at_ok_and_never_counted_as_usage(pair, runtime_dir):
    async def go():
        async with Running(pair_config(pair), runtime_dir) as arb:
            await alternate(arb)
            assert await arb.service.unload("b", admin=True)
            before = await usage(arb, settle=0.0)
            await until(lambda: read_ahead(arb, "b", "read ahead"), 15, "b read ahead")
            after = await usage(arb)
            return before, after, arb.service.model_info("b"), read_ahead(arb, "a", ""), arb.counters.as_dict()

    before, after, b, for_a, counters = asyncio.run(go())
    weights = (pair["b"] / "model.safetensors").stat().st_size
    assert b.prefetched_bytes == weights  # ps: all of its weights
    assert counters["prefetches"] == 1 and counters["prefetch_bytes"] == weights and not for_a
    assert after - before < SIZE // 2, f"usage grew by {(after - before) / 2**20:.0f} MiB"


def test_w4_no_prefetch_while_the_level_is_not_ok(pair, runtime_dir):
    """b is stopped by pressure, leaving a (pinned: pressure never stops it) alone in the
    soft band: nothing is read ahead until the level is ok again."""

    async def go():
        config = pair_config(pair, pinned=("a",), soft_threshold=0.80, hard_threshold=0.99)
        async with Running(config, runtime_dir) as arb:
            await alternate(arb)
            alone = await usage(arb) - worker_usage(arb, "b")
            set_ceiling(arb, alone / 0.9)  # a alone: 90 % of the ceiling (soft); a and b: over it
            await until(lambda: arb.pool.worker_for("b") is None, 30, "b stopped by pressure")
            await asyncio.sleep(2.0)
            level, early = arb.enforcer.last.level, read_ahead(arb, "b", "")
            set_ceiling(arb, alone * 4)
            await until(lambda: read_ahead(arb, "b", "read ahead"), 15, "b read ahead once ok")
            return level, early

    level, early = asyncio.run(go())
    assert level == "soft" and not early, (level, [e.reason for e in early])


def _huge_weights(folder) -> int:
    """b's weights swapped for a valid file of 1 GiB of holes (a new inode: its worker's map
    is not touched): a prefetch of it reads for seconds."""
    size = 1 * GiB
    header = json.dumps({"pad": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    tmp = folder / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)
    os.replace(tmp, folder / "model.safetensors")
    return 8 + len(header) + size


def test_w4_a_prefetch_in_progress_stops_at_soft(pair, tmp_path, runtime_dir):
    folder = tmp_path / "b"
    folder.mkdir()
    for f in pair["b"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    paths = {"a": pair["a"], "b": folder}

    async def go():
        async with Running(pair_config(paths), runtime_dir) as arb:
            await alternate(arb)
            size = _huge_weights(folder)
            loop = asyncio.get_running_loop()
            alone = await usage(arb) - worker_usage(arb, "b")

            def soft_once_reading(ev) -> None:
                if ev.kind == "prefetch" and ev.reason.startswith("reading ahead"):
                    loop.call_later(0.3, set_ceiling, arb, alone / 0.98)  # a alone: 98 % (soft)

            arb.service.add_event_hook(soft_once_reading)
            assert await arb.service.unload("b", admin=True)
            await until(lambda: read_ahead(arb, "b", "prefetch of b stopped"), 20, "the prefetch stopped")
            return size, read_ahead(arb, "b", "prefetch of b stopped"), arb.service.model_info("b"), \
                arb.counters.as_dict()

    size, stopped, b, counters = asyncio.run(go())
    assert "the memory level left ok" in stopped[0].reason, stopped[0].reason
    assert counters["prefetch_cancelled"] == 1 and 0 <= b.prefetched_bytes < size
