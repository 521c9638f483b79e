"""The prompt cache's disk tier (H5, docs/rules.md) through a real
supervisor, real worker processes, real ZeroMQ and real HTTP.

Both ends of the stop's contract run for real: the pool computes the write's
grace and sends it in `Drain.save_seconds`, and escalates `stop_grace + grace`
after the drain; the worker writes until its own deadline and reports what it
wrote and what it dropped (`CacheReport`). A slow or wedged disk is the
worker's test hook `MEMVISOR_TEST_SAVE_DELAY` (seconds each written chunk takes).
"""

from __future__ import annotations

import signal
import time

import pytest

from shared.sizes import MiB
from supervisor.config import GuardConfig, ModelConfig
from tests.http_harness import LiveServer, make_config, metric, until
from worker import kv_files, kv_folder

pytestmark = pytest.mark.slow

# ~600 prompt tokens with the generated tokenizer: an entry worth keeping (H5.1: at least 128)
LONG = "The guard keeps the machine's memory in check while models come and go. " * 40


def chat_config(tiny_models, stop_grace: float = 30.0, **guard):
    guard.setdefault("hot_cache_max", 64 * MiB)
    return make_config([ModelConfig(id="a", path=str(tiny_models.a))], guard=GuardConfig(**guard),
                       stop_grace=stop_grace)


def messages(turn: str = "Tell me about it.") -> list[dict]:
    return [{"role": "system", "content": LONG}, {"role": "user", "content": turn}]


async def stopped(live: LiveServer, handle) -> None:
    await until(lambda: handle.exited.done(), 60, f"{handle.worker_id} to exit")


async def chat_then_unload(live: LiveServer):
    """One chat on model `a` (an entry in its cache), then its unload: the worker it
    had, and how long the unload took to return."""
    await live.openai().chat.completions.create(model="a", messages=messages(), max_tokens=4)
    handle = live.arbiter.pool.worker_for("a")
    started = time.monotonic()
    assert await live.arbiter.service.unload("a", admin=True)
    return handle, time.monotonic() - started


def on_disk(cache_root) -> list:
    """The tier's files (its entries and any temporary file), not the budget's lock."""
    return sorted(p for p in (cache_root / "kv").rglob("*") if p.is_file() and p.name != kv_folder.LOCK_NAME)


def test_h5_an_entry_written_at_a_guard_ordered_stop_is_reused_by_the_next_worker(tiny_models, runtime_dir,
                                                                                 private_cache_dir):
    config = chat_config(tiny_models)
    with LiveServer(config, runtime_dir) as live:
        async def main():
            client = live.openai()
            first = await client.chat.completions.create(model="a", messages=messages(), max_tokens=12,
                                                         temperature=0)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            handle = live.arbiter.pool.worker_for("a")
            async with live.client() as c:
                # P6.2 under pressure: a custom ceiling whose soft watermark (0.90) is 2 MiB over the
                # supervisor's own usage, so that the worker alone keeps the group at hard whatever
                # P5's shrink gives back; the guard stops the idle, unpinned model
                guard = (await c.get("/status")).json()["guard"]
                own = guard["usage"] - sum(w["usage"] for w in guard["workers"])
                r = await c.post("/admin/guard", json={"tier": "custom", "custom_ceiling": int((own + 2 * MiB) / 0.9)})
                assert r.status_code == 200, r.text
                await stopped(live, handle)
                await until(lambda: live.arbiter.pool.caches.model("a").written_entries >= 1, 30,
                            "the stop's write to be reported")
                events = [e for e in live.arbiter.events if e.model_id == "a"]
                assert any(e.kind == "evict" for e in events), [(e.kind, e.reason) for e in events]
                saved = [e for e in events if e.kind == "disk_cache"]
                assert saved and "written" in saved[-1].reason, [(e.kind, e.reason) for e in events]
                assert on_disk(private_cache_dir)
                # visible while the model is unloaded: status, ps (the same ModelInfo), /metrics
                status = (await c.get("/status")).json()
                (model,) = [m for m in status["models"] if m["id"] == "a"]
                assert model["state"] == "unloaded" and model["disk_cache_bytes"] > 0
                assert model["disk_cache_entries"] >= 1
                disk = status["disk_cache"]
                assert disk["written_entries"] >= 1 and disk["bytes"] >= model["disk_cache_bytes"]
                assert 0 < disk["bytes"] <= disk["budget"] and disk["grace"] == 2.0
                text = (await c.get("/metrics")).text
                assert metric(text, "memvisor_model_disk_cache_bytes", model="a") == model["disk_cache_bytes"]
                assert metric(text, "memvisor_disk_cache_written_entries_total") >= 1
                r = await c.post("/admin/guard", json={"tier": "balanced", "custom_ceiling": 0})
                assert r.status_code == 200, r.text
            second = await client.chat.completions.create(model="a", messages=messages(), max_tokens=12,
                                                          temperature=0)
            assert live.arbiter.pool.worker_for("a") is not handle  # a new worker of the model
            details = second.usage.prompt_tokens_details
            assert details.cached_tokens > 0
            assert details.model_extra["disk_cached_tokens"] == details.cached_tokens  # H5.6: read from disk
            assert second.choices[0].message.content == first.choices[0].message.content  # H1 across the tier
            async with live.client() as c:
                await until(lambda: live.arbiter.pool.caches.model("a").read_entries == 1, 10, "the read's report")
                text = (await c.get("/metrics")).text
            assert metric(text, "memvisor_disk_cache_read_entries_total") == 1
            assert metric(text, "memvisor_disk_cache_read_tokens_total") >= details.cached_tokens  # the entry's tokens

        live.run(main(), timeout=300)


def test_h5_a_deadline_too_short_writes_nothing_counts_it_and_does_not_hold_the_stop(tiny_models, runtime_dir,
                                                                                   private_cache_dir, monkeypatch):
    monkeypatch.setenv(kv_files.SAVE_DELAY_ENV, "0.2")  # each chunk 0.2 s: past a 0.05 s grace at the first
    config = chat_config(tiny_models, disk_cache_grace=0.05)
    with LiveServer(config, runtime_dir) as live:
        async def main():
            handle, took = await chat_then_unload(live)
            await until(lambda: live.arbiter.pool.caches.model("a").save_deadline > 0, 10, "the final report")
            return handle, took

        handle, took = live.run(main(), timeout=120)
        stats = live.arbiter.pool.caches.model("a")
        # the worker end: it got the pool's grace on the wire, kept to it, and left on its own
        assert stats.save_deadline == 0.05
        assert (stats.written_entries, stats.dropped_entries) == (0, 1) and stats.dropped_bytes > 0
        assert handle.signals_sent == []
        assert took < 10.0  # the supervisor's escalation (stop_grace 30 s + 0.05 s) was never needed
        assert on_disk(private_cache_dir) == []  # no file, not even a partial one
        assert live.arbiter.service.disk_cache().dropped_entries == 1
        assert any(e.kind == "disk_cache" and "not written" in e.reason for e in live.arbiter.events)


def test_h5_a_write_that_hangs_is_cut_by_sigterm_at_the_stop_grace_plus_the_write_grace(
        tiny_models, runtime_dir, private_cache_dir, monkeypatch):
    monkeypatch.setenv(kv_files.SAVE_DELAY_ENV, "120")  # the first chunk never ends: a wedged disk
    config = chat_config(tiny_models, stop_grace=1.0, disk_cache_grace=1.0)
    with LiveServer(config, runtime_dir) as live:
        handle, took = live.run(chat_then_unload(live), timeout=120)
    # the supervisor end: SIGTERM after stop_grace + the write's grace (2 s), not after the write
    assert signal.SIGTERM in handle.signals_sent and signal.SIGKILL not in handle.signals_sent
    assert 2.0 <= took < 60.0
    assert on_disk(private_cache_dir) == []  # the interrupted write left nothing behind


def test_h6_at_soft_pressure_a_worker_quantizes_its_unused_entries_and_a_later_request_reuses_one(
        tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)],  # pinned: never evicted
                         guard=GuardConfig(hot_cache_max=64 * MiB, cache_quantize_bits=8))
    with LiveServer(config, runtime_dir) as live:
        async def main():
            client = live.openai()
            await until(lambda: live.arbiter.pool.worker_for("a") is not None, 60, "the pinned model")
            await client.chat.completions.create(model="a", messages=messages(), max_tokens=4)
            handle = live.arbiter.pool.worker_for("a")
            await until(lambda: handle.sample is not None and handle.sample.memory.cache_bytes > 0, 10, "a sample")
            held = handle.sample.memory.cache_bytes
            async with live.client() as c:
                usage = (await c.get("/status")).json()["guard"]["usage"]
                # between the custom tier's soft (0.90) and hard (0.97) watermarks
                r = await c.post("/admin/guard", json={"tier": "custom", "custom_ceiling": int(usage / 0.935)})
                assert r.status_code == 200, r.text
                await until(lambda: live.arbiter.service.disk_cache().quantized_entries >= 1, 30, "the quantization report")
                r = await c.post("/admin/guard", json={"tier": "balanced", "custom_ceiling": 0})
                assert r.status_code == 200, r.text
                disk = (await c.get("/status")).json()["disk_cache"]
                text = (await c.get("/metrics")).text
            assert disk["quantize_bits"] == 8 and disk["quantized_entries"] >= 1
            assert 0.4 * held < disk["quantized_bytes"] < 0.6 * held  # float16 KV at 8 bits: about half returns
            assert metric(text, "memvisor_prompt_cache_quantized_bytes_total") == disk["quantized_bytes"]
            await until(lambda: handle.sample.memory.cache_bytes < held, 10, "a sample after the shrink")
            again = await client.chat.completions.create(model="a", messages=messages("And then?"), max_tokens=4)
            assert again.usage.prompt_tokens_details.cached_tokens > 0  # the quantized entry, reused (H6.3)
            assert live.arbiter.pool.worker_for("a") is handle

        live.run(main(), timeout=300)


def test_h5_keep_alive_zero_writes_the_cache_as_its_model_goes(tiny_models, runtime_dir, private_cache_dir):
    with LiveServer(chat_config(tiny_models), runtime_dir) as live:
        async def main():
            async with live.client() as c:
                r = await c.post("/v1/chat/completions", json={"model": "a", "messages": messages(), "max_tokens": 4,
                                                               "keep_alive": 0})
                assert r.status_code == 200, r.text
            handle = live.arbiter.pool.worker_for("a") or live.arbiter.pool.reaped["a"]
            await stopped(live, handle)  # P10 with the request's TTL of ~0: the guard's stop
            await until(lambda: live.arbiter.pool.caches.model("a").written_entries == 1, 30, "the write's report")

        live.run(main(), timeout=120)
        assert any(e.kind == "ttl" and e.model_id == "a" for e in live.arbiter.events)
        assert len(on_disk(private_cache_dir)) == 1
