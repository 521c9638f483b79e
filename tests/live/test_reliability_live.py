"""Liveness and failure handling with real worker processes, real ZeroMQ and real MLX on the CPU.

No healthy worker killed, no model failed for ever, no input that buys a 500.
A long engine step is made deterministic with the worker's test-only step
delay (it sleeps with the GIL released, as MLX does while it evaluates); the
heartbeat thread, the Alive reports and the supervisor's judgement are the
real code path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from shared import protocol as p
from supervisor.config import ModelConfig
from supervisor.doors.refusals import LoadError, ServeError
from tests.arbiter_harness import Running, collect, make_config
from tests.http_harness import until
from worker.main import STEP_DELAY_ENV

pytestmark = pytest.mark.slow


@pytest.fixture
def runtime_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rt", numbered=True)


def test_a_worker_busy_in_a_step_longer_than_the_heartbeat_window_is_not_killed(
        tiny_models, runtime_dir, monkeypatch):
    """Before: one 3 s step against a 1.5 s window -> 'wedged', killed, 503 worker_exited."""
    monkeypatch.setenv(STEP_DELAY_ENV, "3.0")
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)],
                         heartbeat_interval=0.2, heartbeat_timeout=1.5)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            stream = await arb.service.generate("a", p.Generate(request_id="long", prompt="hello there", max_tokens=2))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished), end
            assert handle.state in ("ready", "busy") and handle.beats.alive is not None and handle.beats.alive.steps > 0
            assert not any(e.kind == "wedged" for e in arb.events)
            assert arb.pool.counters.wedged == 0

    asyncio.run(main())


def test_a_sigstopped_worker_inside_a_long_step_is_still_caught_within_the_window(
        tiny_models, runtime_dir, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_ENV, "30.0")
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))],
                         heartbeat_interval=0.2, heartbeat_timeout=1.5)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            stream = await arb.service.generate("a", p.Generate(request_id="stuck", prompt="hello", max_tokens=2))
            await until(lambda: arb.pool.watchdog.step_seconds(handle, time.monotonic()) > 0.5, what="inside the step")
            stopped = time.monotonic()
            os.kill(handle.pid, signal.SIGSTOP)
            await until(lambda: handle.exited.done(), timeout=20, what="wedge caught")
            caught = time.monotonic() - stopped
            assert caught < 1.5 + 0.2 + 2.0 + 3.0  # the window, a beat, the SIGTERM wait, slack on a busy CI
            assert any(e.kind == "wedged" and "no heartbeat" in e.reason for e in arb.events)
            _, end = await collect(stream)
            assert isinstance(end, p.Failed) and end.code == "worker_exited"

    asyncio.run(main())


def test_a_step_past_step_timeout_is_wedged_and_says_so(tiny_models, runtime_dir, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_ENV, "30.0")
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))],
                         heartbeat_interval=0.2, heartbeat_timeout=1.0, step_timeout=2.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            await arb.service.generate("a", p.Generate(request_id="forever", prompt="hello", max_tokens=2))
            await until(lambda: handle.exited.done(), timeout=30, what="step timeout")
            assert any(e.kind == "wedged" and "one engine step has run" in e.reason for e in arb.events)

    asyncio.run(main())


def test_a_worker_that_dies_while_loading_is_a_503_not_a_500(tiny_models, runtime_dir):
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            loading = asyncio.get_running_loop().create_task(arb.models.load("a"))
            await until(lambda: arb.pool.worker_for("a") is not None, what="spawn")
            os.kill(arb.pool.worker_for("a").pid, signal.SIGKILL)
            with pytest.raises(LoadError) as err:
                await asyncio.wait_for(loading, 30)
            assert err.value.http_status == 503 and err.value.code == "worker_exited"
            assert not err.value.permanent

    asyncio.run(main())


def test_a_failed_pinned_model_is_retried_after_its_backoff_and_at_once_on_an_explicit_load(
        tiny_models, runtime_dir):
    """Before: failed for ever; every 503 said Retry-After: 2."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a), pinned=True)],
                         restart_max=1, restart_period=60.0, failed_retry_first=3.0, failed_retry_max=60.0)

    async def crash_until_failed(arb):
        while "a" not in arb.models.failed:
            w = await arb.models.load("a", explicit=True)
            os.kill(w.pid, signal.SIGKILL)
            await until(lambda w=w: w.exited.done(), what="crash noticed")
            await until(lambda: "a" in arb.models.failed or arb.pool.worker_for("a") is not None,
                        what="respawn or failure")

    async def main():
        async with Running(config, runtime_dir) as arb:
            await crash_until_failed(arb)
            with pytest.raises(LoadError, match="next try in") as err:
                await arb.models.load("a")
            assert err.value.http_status == 503 and 1 <= err.value.retry_after <= 3
            assert "next try in" in arb.service.model_view("a").reason
            # healed by the backoff alone: a pinned model comes back by itself
            await until(lambda: (w := arb.pool.worker_for("a")) is not None and w.serving, timeout=30,
                        what="retried after the backoff")
            assert any(e.kind == "retry" for e in arb.events)
            await crash_until_failed(arb)
            retry = arb.models.retry_in("a", time.monotonic())
            assert retry is not None and retry > 3.0  # the backoff grew
            handle = await arb.models.load("a", explicit=True)  # the operator says: now
            assert handle.serving and "a" not in arb.models.failed

    asyncio.run(main())


def test_prompt_plus_max_tokens_over_the_context_is_a_400_naming_both(tiny_models, runtime_dir):
    """Before: a 200k-token prompt (49x the context) was accepted; max_tokens up to 1,000,000 too."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], max_tokens=8192)

    async def main():
        async with Running(config, runtime_dir) as arb:
            with pytest.raises(ServeError) as capped:
                await arb.service.generate("a", p.Generate(request_id="cap", prompt="x", max_tokens=1_000_000))
            assert capped.value.http_status == 400 and "8192" in str(capped.value)
            with pytest.raises(ServeError) as whole:
                await arb.service.generate("a", p.Generate(request_id="ctx", prompt="x", max_tokens=4096))
            assert whole.value.code == "context_length_exceeded" and "4096" in str(whole.value)
            assert arb.pool.worker_for("a") is None  # refused before any worker was started
            long_prompt = " ".join(f"w{i}" for i in range(6000))
            stream = await arb.service.generate("a", p.Generate(request_id="long", prompt=long_prompt, max_tokens=16))
            _, end = await collect(stream)
            assert isinstance(end, p.Failed) and end.code == "context_length_exceeded"
            assert "plus max_tokens (16)" in end.message and "context of 4096 tokens" in end.message

    asyncio.run(main())


def test_a_worker_sigstopped_while_loading_is_caught_within_the_heartbeat_window(
        tiny_models, runtime_dir, monkeypatch):
    """Before: only load_timeout (600 s) caught it, and every load waited behind it (A5)."""
    from worker.main import LOAD_DELAY_ENV

    monkeypatch.setenv(LOAD_DELAY_ENV, "30.0")
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))],
                         heartbeat_interval=0.2, heartbeat_timeout=1.5, load_timeout=600.0)

    async def main():
        async with Running(config, runtime_dir) as arb:
            loading = asyncio.get_running_loop().create_task(arb.models.load("a"))
            await until(lambda: (w := arb.pool.worker_for("a")) is not None and w.beats.last_alive > 0, timeout=30,
                        what="first proof of life")
            handle = arb.pool.worker_for("a")
            stopped = time.monotonic()
            os.kill(handle.pid, signal.SIGSTOP)
            with pytest.raises(LoadError) as err:
                await asyncio.wait_for(loading, 30)
            assert time.monotonic() - stopped < 1.5 + 0.2 + 5.0 + 3.0  # window, beat, SIGTERM wait, slack
            assert err.value.http_status == 503
            assert any(e.kind == "wedged" and "while starting or loading" in e.reason for e in arb.events)

    asyncio.run(main())
