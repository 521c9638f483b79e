"""The prompt cache's disk tier and shrink before drop (H5, H6 in docs/rules.md):
the file format, the folder and its budget, then through the engine on a real tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import msgspec
import pytest

from shared.limits import Limits
from shared.protocol import DISK_CACHE_AUTO, CacheReport, DiskCacheStats
from shared.sizes import GiB
from supervisor.config import GuardConfig
from supervisor.config_file import parse_config
from supervisor.guard.cache_book import CacheBook
from tests.disk_cache_harness import (
    ROOMY,
    ask,
    engine_for,
    engine_with,
    entry,
    files,
    kv,
    long_prompt,
    save_all,
    tier,
)
from tests.engine_harness import drive
from worker import disk_cache, kv_files
from worker import prompt_cache as pc
from worker.disk_cache import model_identity

# ------------------------------------------------------------------ the file (H5.3)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_h5_entry_file_is_safetensors_holding_only_the_tokens_rows(tmp_path, dtype):
    layers = kv(300, dtype=dtype)  # a 512-row buffer: the file holds the 300 rows, written as they lie
    assert layers[0].keys.shape[2] > 300
    arrays = {"0.keys": layers[0].keys[..., :300, :], "0.values": layers[0].values[..., :300, :]}
    path = tmp_path / "e.safetensors"
    n = kv_files.write_entry(path, arrays, {"tokens": "[1,2]"}, deadline=time.monotonic() + 60)
    assert n == path.stat().st_size
    back, metadata = mx.load(str(path), return_metadata=True)
    assert metadata["tokens"] == "[1,2]" and metadata[kv_files.CHECKSUM].startswith("xxh3_128:")  # H5.3
    for name, array in arrays.items():
        assert back[name].dtype == dtype and mx.array_equal(back[name], array).item()
    assert kv_files.read_metadata(path) == (metadata, sum(a.nbytes for a in arrays.values()))


def test_h5_a_file_cut_short_or_with_a_lying_header_is_refused(tmp_path):
    path = tmp_path / "e.safetensors"
    kv_files.write_entry(path, {"k": mx.ones((4, 4))}, {"a": "b"}, deadline=time.monotonic() + 60)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(kv_files.EntryFileError, match="declares"):
        kv_files.read_metadata(path)
    path.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(kv_files.EntryFileError, match="implausible"):
        kv_files.read_metadata(path)


# ------------------------------------------------------------------ the deadline (H5.2)


def test_h5_a_deadline_already_past_writes_nothing_and_counts_every_entry(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    entries = [entry(200, start=i * 1000) for i in range(3)]
    done = t.save(entries, deadline=time.monotonic(), given=0.0)
    assert (done.written, done.dropped) == (0, 3)
    assert done.dropped_bytes == sum(e.nbytes for e in entries)
    assert (t.stats.dropped_entries, t.stats.written_entries) == (3, 0)
    assert [p for p in files(tmp_path) if p.is_file()] == []  # no file, no temporary either


def test_h5_a_write_the_deadline_cuts_leaves_no_partial_file(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr(kv_files, "CHUNK_BYTES", 4096)  # many chunks per entry ...
    monkeypatch.setenv(kv_files.SAVE_DELAY_ENV, "0.01")  # ... each 10 ms on this slow "disk"
    t = tier(tmp_path, tiny_model)
    entries = [entry(200, start=i * 1000) for i in range(2)]  # 2 x 204 KiB: ~100 chunks in all
    started = time.monotonic()
    done = t.save(entries, deadline=started + 0.3, given=0.3)
    took = time.monotonic() - started
    assert done.written == 0 and done.dropped == 2
    assert took < 0.3 + 0.5  # one chunk past its deadline at most (0.5 s: a loaded machine's slack)
    assert [p.name for p in files(tmp_path) if p.is_file()] == []


def test_h5_an_abandoned_write_of_a_dead_process_is_removed_at_the_next_index(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    t.save([entry(200)], deadline=time.monotonic() + 60)
    (written,) = t.entries.values()
    whole = (t.folder / written.name).read_bytes()
    (t.folder / written.name).unlink()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = t.folder / f"{written.name}{kv_files.TMP_MARK}{int(dead.stdout)}"
    mine = t.folder / f"{written.name}{kv_files.TMP_MARK}{os.getpid()}"  # a write under way
    stale.write_bytes(whole[:len(whole) // 2])  # its header whole: provably ours (H5.3)
    mine.write_bytes(whole[:len(whole) // 2])
    tier(tmp_path, tiny_model)
    assert not stale.exists() and mine.exists()


# ------------------------------------------------------------------ the folder and its budget (H5.3, H5.4)


def test_h5_index_reads_headers_only(tmp_path, tiny_model, monkeypatch):
    tier(tmp_path, tiny_model).save([entry(200), entry(150, start=5000)], deadline=time.monotonic() + 60)

    def no_data(*_a, **_k):
        raise AssertionError("the index read an entry's data")

    monkeypatch.setattr(disk_cache.mx, "load", no_data)
    again = tier(tmp_path, tiny_model)
    assert sorted(len(e.tokens) for e in again.entries.values()) == [150, 200]
    assert again.stats.entries == 2 and again.stats.bytes == sum(e.nbytes for e in again.entries.values())


def test_h5_a_changed_model_gets_a_new_folder_and_never_reads_the_old_entries(tmp_path, tiny_models):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_models.a.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    old = tier(tmp_path / "kv", model)
    old.save([entry(200)], deadline=time.monotonic() + 60)
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10 ** 9))
    assert model_identity(model) != old.identity
    new = tier(tmp_path / "kv", model)
    assert new.folder != old.folder and new.entries == {}
    assert new.best(tuple(range(200)), 199, 0) is None
    assert new.stats.all_bytes == old.stats.bytes > 0  # the old folder's file still counts for the budget


def test_h5_budget_least_recently_used_goes_first_whatever_its_model(tmp_path, tiny_models):
    root = tmp_path / "kv"
    probe = tier(tmp_path / "probe", tiny_models.a)
    probe.save([entry(200)], deadline=time.monotonic() + 60)
    budget = int(2.5 * probe.stats.bytes)  # room for two files, not three
    a = tier(root, tiny_models.a, budget, model_id="a")
    b = tier(root, tiny_models.b, budget, model_id="b")
    a.save([entry(200, start=0)], deadline=time.monotonic() + 60)
    time.sleep(0.02)
    b.save([entry(200, start=1000)], deadline=time.monotonic() + 60)
    time.sleep(0.02)
    a.save([entry(200, start=2000)], deadline=time.monotonic() + 60)  # a's first one is the oldest: it goes
    held = [p for p in files(root) if p.suffix == ".safetensors"]
    assert sum(p.stat().st_size for p in held) <= budget and len(held) == 2
    assert sorted(e.tokens[0] for e in a.entries.values()) == [2000]
    assert a.stats.evicted_entries == 1 and a.stats.all_bytes <= budget
    assert tier(root, tiny_models.b, budget, model_id="b").stats.entries == 1


def test_h5_an_entry_over_the_budget_is_not_written(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model, 1000)
    done = t.save([entry(200)], deadline=time.monotonic() + 60)
    assert (done.written, done.dropped) == (0, 0) and t.entries == {}


def test_h5_auto_budget_is_a_quarter_of_the_free_disk_and_no_write_crosses_the_free_floor(tmp_path, tiny_model):
    assert tier(tmp_path, tiny_model).budget == ROOMY[2] // 4
    size = entry(200).nbytes
    total = 100 * GiB
    floor = max(disk_cache.FREE_FLOOR, int(total * disk_cache.FREE_FLOOR_SHARE))

    def nearly_full(_path):
        return total, total - floor - size // 2, floor + size // 2  # half the entry fits above the floor

    t = tier(tmp_path, tiny_model, 10 * GiB, disk_usage=nearly_full)
    assert t.save([entry(200)], deadline=time.monotonic() + 60).written == 0


def test_h5_short_entries_and_prefixes_of_another_are_not_written(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    long = entry(300)
    prefix = pc.Entry(long.tokens[:200], kv(200))
    done = t.save([entry(disk_cache.MIN_TOKENS - 1, start=9000), prefix, long], deadline=time.monotonic() + 60)
    assert done.written == 1 and [len(e.tokens) for e in t.entries.values()] == [300]


def test_h5_a_corrupt_file_is_a_miss_and_is_removed(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    t.save([entry(200)], deadline=time.monotonic() + 60)
    (found,) = t.entries.values()
    path = t.folder / found.name
    path.write_bytes(path.read_bytes()[:-100])  # cut in its data: the header still proves it ours
    assert t.load(found) is None and not path.exists() and t.entries == {}
    assert t.stats.rejected_entries == 1


# ------------------------------------------------------------------ through the engine (H5.5, H5.6)


def test_h5_a_new_engine_reads_the_entry_back_and_its_greedy_reply_is_identical(loaded, tiny_model, tmp_path):
    first = engine_with(loaded, tmp_path, tiny_model)
    prompt = long_prompt(first)
    expected, end = ask(first, prompt)
    assert end.cached_tokens == 0
    assert save_all(first).written == 1

    second = engine_with(loaded, tmp_path, tiny_model)  # a new worker of the same model
    assert second.prompt_cache.nbytes == 0
    tokens, end = ask(second, prompt)
    assert tokens == expected  # H1 across the disk tier
    assert end.cached_tokens == end.cached_disk_tokens == len(prompt) - 1
    assert second.disk is not None and second.disk.stats.read_entries == 1
    tokens, end = ask(second, prompt, rid="again")  # now from memory: not read from disk again
    assert tokens == expected and end.cached_tokens == len(prompt) - 1 and end.cached_disk_tokens == 0
    assert second.disk.stats.read_entries == 1


def test_h5_memory_wins_when_it_has_as_much_and_no_file_is_read(loaded, tiny_model, tmp_path):
    engine = engine_with(loaded, tmp_path, tiny_model)
    prompt = long_prompt(engine)
    ask(engine, prompt)
    save_all(engine)
    _, end = ask(engine, prompt, rid="b")
    assert end.cached_tokens > 0 and end.cached_disk_tokens == 0 and engine.disk.stats.read_entries == 0


def test_h5_an_entry_over_the_memory_cap_is_not_read(loaded, tiny_model, tmp_path):
    engine = engine_with(loaded, tmp_path, tiny_model)
    prompt = long_prompt(engine)
    ask(engine, prompt)
    save_all(engine)
    small = engine_for(loaded, max_chunk=64)
    small.step(Limits(max_concurrency=8, cache_cap=1024), lambda: 0)
    small.use_disk_tier(tier(tmp_path, tiny_model))
    small.submit("r", prompt, max_tokens=2)
    end = drive(small, Limits(max_concurrency=8, cache_cap=1024)).terminal("r")
    assert end.cached_tokens == 0 and small.disk is not None and small.disk.stats.read_entries == 0


# ------------------------------------------------------------------ shrink before drop (H6)


def test_h6_quantizing_returns_bytes_and_the_entry_is_still_reused(loaded, tmp_path):
    engine = engine_for(loaded, max_chunk=64)
    prompt = long_prompt(engine)
    ask(engine, prompt)
    before = engine.cache_bytes
    count, returned = engine.quantize_cache(8)
    assert count == 1 and returned == before - engine.cache_bytes
    assert engine.cache_bytes < 0.6 * before  # float16 KV at 8 bits: about half, scales and biases included
    (stored,) = engine.prompt_cache.recent_first()
    assert stored.bits == 8
    _, end = ask(engine, prompt, rid="b")
    assert end.cached_tokens == len(prompt) - 1  # reused (H6.3: its reply may differ from H1's)


def test_h6_quantize_spares_entries_in_use_and_stops_at_the_target(tmp_path):
    cache = pc.PromptCache(GiB)
    for i in range(3):
        cache.insert(tuple(range(i * 1000, i * 1000 + 200)), kv(200, seed=i))
    pinned = cache.lookup(tuple(range(2000, 2200)), 199)
    assert pinned is not None
    one = pinned.entry.nbytes
    count, returned = cache.quantize_unused(4, to_bytes=cache.nbytes - 1)  # one entry is enough
    assert count == 1 and returned > 0
    assert [e.bits for e in cache.recent_first()] == [0, 0, 4]  # the least recently used one
    count, _ = cache.quantize_unused(4)
    assert count == 1 and pinned.entry.bits == 0 and pinned.entry.nbytes == one
    assert cache.nbytes == sum(e.nbytes for e in cache.recent_first())


def test_h6_a_quantized_entry_round_trips_through_the_disk_tier(tmp_path, tiny_model):
    cache = pc.PromptCache(GiB)
    tokens = tuple(range(200))
    cache.insert(tokens, kv(200))
    cache.quantize_unused(8)
    (stored,) = cache.recent_first()
    t = tier(tmp_path, tiny_model)
    assert t.save([stored], deadline=time.monotonic() + 60).written == 1
    back = tier(tmp_path, tiny_model)
    found = back.best(tokens, 199, 0)
    assert found is not None
    layers = back.load(found)
    assert layers is not None and pc.Entry(tokens, layers).bits == 8
    hit = pc.Hit(pc.Entry(tokens, layers), 199)
    assert all(mx.allclose(a.keys[..., :199, :], b.keys[..., :199, :]).item()
               for a, b in zip(pc.PromptCache.fork(hit), pc.PromptCache.fork(pc.Hit(stored, 199))))


# ------------------------------------------------------------------ configuration and the supervisor's book


def test_h5_config_disk_cache_max_is_auto_by_default_a_size_or_off():
    assert GuardConfig().disk_cache_max == DISK_CACHE_AUTO
    assert parse_config('[guard]\ndisk_cache_max = "8GiB"').guard.disk_cache_max == 8 * GiB
    assert parse_config('[guard]\ndisk_cache_max = "auto"').guard.disk_cache_max == DISK_CACHE_AUTO
    assert parse_config("[guard]\ndisk_cache_max = 0").guard.disk_cache_max == 0
    for bad, words in (("disk_cache_max = \"lots\"", "guard.disk_cache_max"),
                       ("disk_cache_grace = 600", "guard.disk_cache_grace"),
                       ("cache_quantize_bits = 2", "guard.cache_quantize_bits")):
        with pytest.raises(ValueError, match=words):
            parse_config(f"[guard]\n{bad}")


def test_h5_the_stop_grace_is_off_without_a_disk_tier_or_without_a_memory_tier():
    from supervisor.guard.cache_book import save_grace

    def grace(**guard) -> float:
        return save_grace(GuardConfig(**guard))

    assert grace(disk_cache_grace=1.5) == 1.5
    assert grace(disk_cache_grace=1.5, disk_cache_max=0) == 0.0
    assert grace(disk_cache_grace=1.5, hot_cache_max=0) == 0.0


def test_h5_the_book_keeps_an_unloaded_models_bytes_and_adds_up_every_workers_counts():
    book = CacheBook()

    def report(worker: str, model: str, **stats) -> CacheReport:
        return CacheReport(worker_id=worker, model_id=model, pid=1, stats=DiskCacheStats(**stats))

    book.take(report("a#1", "a", entries=1, bytes=10, all_bytes=10, budget=100, written_entries=1))
    book.take(report("a#2", "a", entries=1, bytes=10, all_bytes=30, budget=100, read_entries=1, read_tokens=7))
    book.take(report("b#3", "b", entries=2, bytes=20, all_bytes=30, budget=100, dropped_entries=2))
    status = book.status(DISK_CACHE_AUTO, 2.0, 0)
    assert (status.written_entries, status.read_entries, status.read_tokens, status.dropped_entries) == (1, 1, 7, 2)
    assert (status.bytes, status.budget, status.entries, status.models) == (30, 100, 3, {"a": 10, "b": 20})
    assert book.model("gone") == DiskCacheStats()
    assert json.loads(json.dumps(status.models)) == {"a": 10, "b": 20}


def test_h5_status_and_ps_show_the_disk_tier_also_for_an_unloaded_model():
    from supervisor.cli.ps import table
    from supervisor.cli.status import render
    from supervisor.policy.pressure import tick
    from supervisor.policy.snapshot import Snapshot
    from supervisor.policy.status import DiskCacheStatus, ModelInfo, ServerStatus, build_status
    from tests.prompt_cache_harness import GUARD, HOST, worker

    s = Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[worker("a", 100 * 1024 ** 2)])
    models = [ModelInfo(id="m-a", path="/m", pinned=False, state="ready", worker="a", disk_cache_bytes=3 * 1024 ** 2),
              ModelInfo(id="m-b", path="/n", pinned=False, state="unloaded", disk_cache_bytes=5 * 1024 ** 2)]
    disk = DiskCacheStatus(max=DISK_CACHE_AUTO, budget=10 * GiB, bytes=8 * 1024 ** 2, entries=3, grace=2.0,
                           read_entries=1, read_tokens=1500, written_entries=3, dropped_entries=1)
    status = ServerStatus(pid=1, uptime=1.0, runtime_dir="rt", pub="ipc://pub", http="", guard=build_status(s, tick(s)),
                          models=models, events=[], malformed_frames=0, counters={}, disk_cache=disk)
    text = render(status)
    assert "prompt cache on disk 8 MiB of 10 GiB budget, 3 entries (a stop writes for up to 2 s)" in text
    assert "read back 1" in text and "1500 tokens" in text and "a stop's deadline first: 1" in text
    assert "5 MiB of prompt cache on disk" in next(line for line in text.splitlines() if line.startswith(" m-b"))
    assert "3 MiB" in next(line for line in text.splitlines() if line.startswith(" m-a"))
    off = render(msgspec.structs.replace(status, disk_cache=DiskCacheStatus(max=0)))
    assert "prompt cache on disk: off (disk_cache_max = 0)" in off
    listing = table(models).splitlines()
    assert "DISK" in listing[0] and "5 MiB" in listing[2]


def test_h5_watch_shows_the_disk_tier_from_the_status_topic_and_nothing_when_it_is_off():
    from rich.console import Console

    from shared import protocol as p
    from supervisor.cli.watch import _View
    from supervisor.policy.pressure import tick
    from supervisor.policy.snapshot import Snapshot
    from supervisor.policy.status import DiskCacheStatus, ServerStatus, build_status
    from tests.prompt_cache_harness import GUARD, HOST, worker

    s = Snapshot(now=1.0, guard=GUARD, host=HOST, workers=[worker("a", 100 * 1024 ** 2)])
    disk = DiskCacheStatus(max=DISK_CACHE_AUTO, budget=10 * GiB, bytes=8 * 1024 ** 2, entries=3, grace=2.0,
                           read_entries=2, read_tokens=1500, written_entries=3, dropped_entries=1)
    status = ServerStatus(pid=1, uptime=1.0, runtime_dir="rt", pub="ipc://pub", http="", guard=build_status(s, tick(s)),
                          models=[], events=[], malformed_frames=0, counters={}, disk_cache=disk)

    def shown(*msgs) -> str:
        view = _View()
        for msg in msgs:
            view.take(msg)
        console = Console(width=220, record=True, color_system=None)
        console.print(view.render())
        return console.export_text()

    text = shown(p.StatusMsg(t=1.0, status=msgspec.json.encode(status)))
    assert "prompt cache on disk 8 MiB of 10 GiB budget, 3 entries" in text
    assert "read back 2 (1500 tokens)" in text and "written 3" in text and "dropped 1" in text
    off = msgspec.structs.replace(status, disk_cache=DiskCacheStatus(max=0))
    assert "on disk" not in shown(p.StatusMsg(t=1.0, status=msgspec.json.encode(off)))
    # a status it cannot read leaves the last good line, and the view goes on
    assert "on disk 8 MiB" in shown(p.StatusMsg(t=1.0, status=msgspec.json.encode(status)),
                                    p.StatusMsg(t=2.0, status=b"{not json"))


def test_h5_watch_and_status_read_the_disk_budget_alike_before_any_worker_reported():
    from supervisor.cli.status import disk_budget
    from supervisor.cli.watch import _disk_line
    from supervisor.policy.status import DiskCacheStatus

    fixed = DiskCacheStatus(max=2 * GiB)  # configured, no worker has measured the folder yet
    assert disk_budget(fixed) == "2 GiB" and "of 2 GiB budget" in _disk_line(fixed)
    assert "of auto budget" in _disk_line(DiskCacheStatus(max=DISK_CACHE_AUTO))
