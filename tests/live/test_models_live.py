"""The model catalogue through real worker processes: aliases, "will it fit?", `ps`,
reload without restart, and memory that really came back after a stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from shared import probe
from shared import protocol as p
from supervisor.config import Config, ModelConfig
from supervisor.config_file import load_config
from supervisor.doors.refusals import LoadError, ServeError
from supervisor.models.discovery import with_discovered
from tests.arbiter_harness import Running, collect, make_config
from tests.http_harness import until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory) -> Path:
    """Large enough that a ceiling can sit between 'fits' and 'fits after an eviction'
    with margins wider than the jitter of the workers' measured usage."""
    from modelfiles.modelgen import make_model
    from shared.sizes import MiB

    path = tmp_path_factory.mktemp("medium") / "medium"
    make_model(path, 48 * MiB, 7, dtype="float32")
    return path


def _models(tiny_models, **extra) -> list[ModelConfig]:
    return [ModelConfig(id="a", path=str(tiny_models.a), aliases=["gpt-4o-mini"], **extra),
            ModelConfig(id="b", path=str(tiny_models.b))]


def test_an_alias_routes_to_its_model(tiny_models, runtime_dir):
    config = make_config(_models(tiny_models))

    async def main():
        async with Running(config, runtime_dir) as arb:
            stream = await arb.service.generate("gpt-4o-mini", p.Generate(request_id="r1", prompt="hello", max_tokens=3))
            _, end = await collect(stream)
            assert isinstance(end, p.Finished)
            assert stream.model_id == "a" and stream.worker_id.startswith("a#")
            assert arb.service.model_info("gpt-4o-mini").state in ("ready", "busy")

    asyncio.run(main())


def test_dry_runs_agree_with_the_real_load_decisions(tiny_models, medium_model, runtime_dir):
    """A dry run spawns nothing; its verdict (fits, evictions, the 507 words) is the real load's."""
    config = make_config(_models(tiny_models) + [ModelConfig(id="small", path=str(medium_model))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            await arb.models.load("b")
            if any(probe.gpu_kind(h.device_info) == "cuda" for h in arb.pool.handles.values()):
                pytest.skip("a host-RAM scenario: on a CUDA device loads count against the device pool "
                            "(D5; tests/live/test_d_device_live.py and tests/test_d_device_tick.py)")
            await until(lambda: arb.service.model_info("a").usage > 0 and arb.service.model_info("b").usage > 0, what="samples")
            await asyncio.sleep(0.5)  # both past their first allocations
            arb.enforcer.tick(time.monotonic())
            usage = arb.enforcer.last.usage
            size_small = (await arb.service.fit("small")).weight_bytes
            # room for what runs plus the small model only if one idle model goes first
            ceiling = usage + size_small // 2
            arb.service.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=int(ceiling / 0.9) + 1))
            before = set(arb.pool.handles)
            report = await arb.service.fit("small")
            assert set(arb.pool.handles) == before, "a dry run spawned or stopped something"
            assert report.fits and report.evict == ["a"], report
            await arb.models.load("small")
            assert arb.pool.worker_for("a") is None and arb.pool.worker_for("b") is not None
            # now a model larger than the whole ceiling: refused the same way, dry or not
            arb.service.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=size_small // 4))
            await until(lambda: arb.pool.worker_for("small") is None, what="pressure stops small")
            refused = await arb.service.fit("small", context_tokens=100)
            assert not refused.fits and refused.error == "model_too_large"
            assert refused.kv_bytes > 0 and refused.estimated_bytes == refused.weight_bytes + refused.kv_bytes
            with pytest.raises(LoadError) as err:
                await arb.models.load("small")
            assert err.value.http_status == 507 and err.value.code == refused.error
            assert str(err.value) == (await arb.service.fit("small")).message  # the same words, dry or not

    asyncio.run(main())


def test_a2_estimate_is_within_25_percent_of_what_the_load_took(tiny_models, runtime_dir):
    """The weight estimate (from safetensors headers) against MLX's active bytes after the load."""
    config = make_config(_models(tiny_models))

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("b")
            estimate = arb.service.model_info("b").estimated_bytes
            # a sample taken once the weights are in (an early one may show a few bytes)
            await until(lambda: arb.service.model_info("b").mlx_active > estimate // 2, what="a sample after the load")
            info = arb.service.model_info("b")
            error = abs(info.estimated_bytes - info.mlx_active) / info.mlx_active
            assert error <= 0.25, (info.estimated_bytes, info.mlx_active)
            on_cuda = any(probe.gpu_kind(h.device_info) == "cuda" for h in arb.pool.handles.values())
            assert on_cuda or info.usage >= info.mlx_active  # on CUDA the weights are device memory (D1)

    asyncio.run(main())


def test_ps_shows_memory_idle_ttl_and_expiry(tiny_models, runtime_dir):
    config = make_config(_models(tiny_models, ttl=600.0))

    async def main():
        async with Running(config, runtime_dir) as arb:
            await arb.models.load("a")
            await until(lambda: arb.service.model_info("a").usage > 0, what="first sample")
            out = await asyncio.get_running_loop().run_in_executor(None, lambda: subprocess.run(
                [sys.executable, "-m", "supervisor", "ps", "--json", "--runtime-dir", str(runtime_dir)],
                cwd=ROOT, capture_output=True, text=True, timeout=60))
            text = await asyncio.get_running_loop().run_in_executor(None, lambda: subprocess.run(
                [sys.executable, "-m", "supervisor", "ps", "--all", "--runtime-dir", str(runtime_dir)],
                cwd=ROOT, capture_output=True, text=True, timeout=60))
            return out, text

    out, text = asyncio.run(main())
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)  # only the loaded model without --all
    assert row["id"] == "a" and row["aliases"] == ["gpt-4o-mini"] and row["state"] in ("ready", "busy")
    assert row["estimated_bytes"] > 0 and row["usage"] > 0 and row["mlx_active"] > 0
    assert row["ttl"] == 600.0 and 0 < row["expires_in"] <= 600.0
    assert "ESTIMATE" in text.stdout and "a (gpt-4o-mini)" in text.stdout and "\nb " in text.stdout


def test_reload_adds_removes_and_changes_models_while_another_streams(tiny_models, runtime_dir, tmp_path):
    config_file = tmp_path / "memvisor.toml"

    def write(models: str) -> None:
        config_file.write_text('[supervisor]\nhttp = "127.0.0.1:0"\nheartbeat_interval = 0.2\n'
                               'heartbeat_timeout = 5.0\nstop_grace = 3.0\n' + models)

    def model(mid: str, path: Path, extra: str = "") -> str:
        return f'[[models]]\nid = "{mid}"\npath = "{path}"\n{extra}\n'

    write(model("a", tiny_models.a) + model("b", tiny_models.b) + model("d", tiny_models.a))

    def reload_config() -> Config:
        return with_discovered(load_config(config_file))[0]

    async def main():
        from supervisor.arbiter import Arbiter

        arb = Arbiter(reload_config(), runtime_dir, max_workers=8, http=False, reload_config=reload_config)
        task = asyncio.get_running_loop().create_task(arb.run())
        await until(lambda: arb.running, what="start")
        try:
            a = await arb.models.load("a")
            b = await arb.models.load("b")
            d = await arb.models.load("d")
            long = await arb.service.generate("a", p.Generate(request_id="long", prompt="once upon", max_tokens=400))
            write(model("a", tiny_models.a, "ttl = 900\nmax_concurrency = 2") + model("c", tiny_models.small)
                  + model("d", tiny_models.b))
            summary = await arb.service.reload("test")
            assert "added c" in summary and "removed b" in summary and "changed a" in summary, summary
            assert "restarted d" in summary, summary
            await until(lambda: b.state == "stopped", what="removed model stopped")
            await until(lambda: arb.pool.worker_for("d") is not None and arb.pool.worker_for("d") is not d
                        and arb.pool.worker_for("d").serving, timeout=60, what="d restarted")
            assert arb.pool.worker_for("a") is a and a.model.ttl == 900 and a.model.max_concurrency == 2
            assert arb.config.model("c") is not None and arb.config.model("b") is None
            _, end = await collect(long)
            assert isinstance(end, p.Finished), end  # the stream on `a` never noticed
            kinds = [e.kind for e in arb.events]
            assert {"model_added", "model_removed", "model_changed", "reload"} <= set(kinds)
            # a bad config is refused with its key path; the running one stays
            config_file.write_text('[guard]\nsoft_threshold = 1.5\n' + model("z", tiny_models.a))
            with pytest.raises(ServeError) as err:
                await arb.service.reload("test")
            assert err.value.http_status == 400 and "guard.soft_threshold" in str(err.value)
            assert arb.config.model("c") is not None and arb.config.model("z") is None
            assert arb.events[-1].kind == "reload_refused"
            # SIGHUP reloads too
            write(model("a", tiny_models.a) + model("c", tiny_models.small) + model("e", tiny_models.b))
            os.kill(os.getpid(), signal.SIGHUP)
            await until(lambda: arb.config.model("e") is not None, what="SIGHUP reload")
            exits = [e for e in arb.events if e.kind == "exit" and e.model_id == "b"]
            assert exits and "returned" in exits[-1].reason and "gone" in exits[-1].reason, exits
        finally:
            arb.stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_reload_over_the_control_socket_answers_with_the_changes(tiny_models, runtime_dir):
    config = make_config(_models(tiny_models))

    async def main():
        from supervisor.wiring.control_answers import handle_control

        async with Running(config, runtime_dir) as arb:
            refused = await handle_control(arb.service, p.ReloadRequest())
            assert isinstance(refused, p.ControlError) and refused.code == "reload_unsupported"
            arb.reloader.build = lambda: msgspec.structs.replace(config, models=config.models[:1])
            reply = await handle_control(arb.service, p.ReloadRequest())
            assert isinstance(reply, p.ControlOk) and "removed b" in reply.detail

    asyncio.run(main())


def test_http_dry_run_and_model_cards(tiny_models, runtime_dir):
    """`POST /v1/models/{id}/load?dry_run=true` spawns nothing; the cards carry the `ps` fields."""
    from tests.http_harness import LiveServer

    with LiveServer(make_config(_models(tiny_models)), runtime_dir) as server:
        async def main():
            async with server.client() as c:
                dry = await c.post("/v1/models/gpt-4o-mini/load", params={"dry_run": "true", "context": "64"})
                bad = await c.post("/v1/models/a/load", params={"dry_run": "true", "context": "-3"})
                spawned = len(server.arbiter.pool.handles)
                await c.post("/v1/models/a/load")
                card = (await c.get("/v1/models/gpt-4o-mini")).json()
                return dry, bad, spawned, card

        dry, bad, spawned, card = server.run(main())
    assert dry.status_code == 200 and spawned == 0
    body = dry.json()
    assert body["model"] == "a" and body["fits"] is True and body["context_tokens"] == 64 and body["kv_bytes"] > 0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "context"
    assert card["id"] == "a" and card["memvisor"]["aliases"] == ["gpt-4o-mini"]
    assert card["memvisor"]["estimated_bytes"] > 0


def test_a_load_waiting_for_the_load_lock_starts_no_worker_once_shutdown_began(tiny_models, runtime_dir):
    """A5 serialises loads; a load still waiting on that lock when the
    supervisor starts to shut down must not spawn afterwards: the shutdown has
    already gathered the workers it stops, so a late spawn would be an orphan
    process outliving its supervisor."""
    config = make_config(_models(tiny_models))

    async def main():
        running = Running(config, runtime_dir)
        arb = await running.__aenter__()
        lock = arb.models._load_lock
        await lock.acquire()  # another load holds it
        waiting = asyncio.get_running_loop().create_task(arb.models.load("a"))
        await asyncio.sleep(0.2)
        arb.stop("test")
        await until(lambda: not arb.running, 5)
        await asyncio.sleep(0.2)  # the shutdown is under way
        lock.release()
        with pytest.raises(LoadError) as refused:
            await asyncio.wait_for(waiting, 30)
        await asyncio.wait_for(running.task, 30)
        return arb, refused.value

    arb, refused = asyncio.run(main())
    assert refused.code == "shutting_down" and refused.http_status == 503
    assert arb.pool.counters.spawned == 0 and not arb.pool.handles
