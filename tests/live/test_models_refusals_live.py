"""Model files that cannot be a model are refused in words, never as a 500
and never by a worker that reads them first.

Before: a FIFO as model.safetensors, a sparse GGUF or one claiming 2**40 keys in a
models folder were served as models whose load answered 500 `model_unreadable`
("our bug"); a 1 GiB sparse config.json passed every check, its worker read it
(2 GiB RSS) and was killed as wedged. Now a models folder's refused files are no
model (a `refused` event, a 404 that says why), a configured entry whose files are
refused is a 422 before any spawn, and the worker refuses an oversize config.json
itself before mlx_lm reads it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from supervisor.arbiter import Arbiter
from supervisor.config import Config, ModelConfig, SupervisorConfig
from supervisor.doors.refusals import LoadError
from supervisor.models.discovery import with_discovered
from supervisor.wiring.control_answers import MAX_CONTEXT_TOKENS
from tests import model_files
from tests.arbiter_harness import Running, make_config
from tests.http_harness import LiveServer
from tests.http_harness import make_config as http_config

pytestmark = pytest.mark.slow

SPARSE = 64 * 1024 * 1024  # over config.json's 4 MiB cap; sparse, so the disk holds a few KB


def _sparse_config(folder: Path, size: int = SPARSE) -> Path:
    with open(folder / "config.json", "wb") as handle:
        handle.write(b'{"model_type": "llama", "pad": "')
        handle.truncate(size)
    return folder


def _hostile_folder(root: Path, tiny: Path) -> Path:
    """A models folder of one good model and four that are not what they say."""
    shutil.copytree(tiny, root / "good")
    fifo = root / "fifo-model"
    fifo.mkdir()
    shutil.copy(tiny / "config.json", fifo / "config.json")
    os.mkfifo(fifo / "model.safetensors")
    sparse = root / "sparse-config"
    sparse.mkdir()
    model_files.safetensors(sparse / "model.safetensors")
    _sparse_config(sparse)
    with open(root / "sparse.gguf", "wb") as handle:  # a header, then nothing but zeros
        handle.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1))
        handle.truncate(SPARSE)
    with open(root / "liar.gguf", "wb") as handle:
        handle.write(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40) + b"k" * 64)
    return root


def test_refused_files_in_a_models_folder_are_no_model_a_404_naming_why_and_a_refused_event(
        tiny_models, tmp_path, runtime_dir):
    folder = _hostile_folder(tmp_path / "models", tiny_models.a)
    base = Config(supervisor=SupervisorConfig(models_dirs=[str(folder)], heartbeat_interval=0.2))
    config, warnings = with_discovered(base)
    assert [m.id for m in config.models] == ["good"]
    assert sum("skipped, not a model" in w for w in warnings) == 4, warnings

    async def main():
        arb = Arbiter(config, runtime_dir, max_workers=4, http=False,
                      reload_config=lambda: with_discovered(base)[0])
        task = asyncio.get_running_loop().create_task(arb.run())
        try:
            while not arb.running:
                await asyncio.sleep(0.01)
            reasons = {"fifo-model": "named pipe", "sparse-config": "over the 4194304-byte cap",
                       "sparse": "no tensor data", "liar": "implausible GGUF counts"}
            for model_id, why in reasons.items():
                with pytest.raises(LoadError) as err:
                    await arb.models.load(model_id)
                assert err.value.http_status == 404 and err.value.code == "model_not_found"
                assert "were refused" in str(err.value) and why in str(err.value), str(err.value)
            refused = {e.model_id for e in arb.events if e.kind == "refused"}
            assert refused == set(reasons), list(arb.events)
            serving = {h.model_id for h in arb.pool.handles.values()} - {""}  # "": a spare (W1) has no model
            assert not serving, f"a refused model got a worker: {serving}"
            # a reload finds one more, says it once, and keeps the rest said once
            _sparse_config(shutil.copytree(tiny_models.a, folder / "late"))
            await arb.service.reload("test")
            assert [e.model_id for e in arb.events if e.kind == "refused"].count("late") == 1
            assert len([e for e in arb.events if e.kind == "refused"]) == 5
            assert arb.service.counters()["model_files_refused"] == 5
        finally:
            arb.stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_a_configured_model_with_a_1_gib_config_json_is_a_422_before_any_spawn(
        tiny_models, tmp_path, runtime_dir):
    folder = _sparse_config(shutil.copytree(tiny_models.a, tmp_path / "big-config"), 1 << 30)
    config = make_config([ModelConfig(id="big", path=str(folder))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            for attempt in (arb.models.load("big"), arb.service.fit("big")):
                with pytest.raises(LoadError) as err:
                    await attempt
                assert err.value.http_status == 422 and err.value.code == "model_unreadable"
                assert "config.json" in str(err.value) and "cap" in str(err.value), str(err.value)
            assert arb.pool.counters.spawned == 0 and not arb.pool.handles, "a worker was spawned"

    asyncio.run(main())


def test_the_worker_refuses_an_oversize_config_json_before_mlx_lm_reads_it(
        tiny_models, tmp_path, runtime_dir):
    """The supervisor's check skipped (a spawn straight from the pool): the worker's own."""
    folder = _sparse_config(shutil.copytree(tiny_models.a, tmp_path / "big-config"))
    config = make_config([ModelConfig(id="big", path=str(folder))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = arb.pool.spawn(config.models[0])
            with pytest.raises(LoadError) as err:
                await asyncio.wait_for(handle.loaded, 30)
            assert "over the 4194304-byte cap" in str(err.value), str(err.value)

    asyncio.run(main())


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    fifo = root / "fifo"
    fifo.mkdir()
    shutil.copy(tiny_models.a / "config.json", fifo / "config.json")
    os.mkfifo(fifo / "model.safetensors")
    models = [ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="fifo", path=str(fifo))]
    with LiveServer(http_config(models), tmp_path_factory.mktemp("rt")) as live:
        yield live


def test_a_configured_model_with_a_fifo_for_weights_is_a_422_to_http_load_dry_run_and_chat(server):
    async def main():
        async with server.client() as client:
            answers = [await client.post("/v1/models/fifo/load", json={}),
                       await client.post("/v1/models/fifo/load?dry_run=true", json={}),
                       await client.post("/v1/chat/completions", json={
                           "model": "fifo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})]
        for answer in answers:
            assert answer.status_code == 422, answer.text
            error = answer.json()["error"]
            assert error["code"] == "model_unreadable" and "named pipe" in error["message"], error

    server.run(main())


def test_the_dry_run_context_is_bounded_as_the_cli_s(server):
    async def main():
        async with server.client() as client:
            def dry(context: str):
                return client.post(f"/v1/models/a/load?dry_run=true&context={context}", json={})

            ok = await dry(str(MAX_CONTEXT_TOKENS))  # before: anything over 10**9 was a 400
            too_many = await dry(str(MAX_CONTEXT_TOKENS + 1))
            huge = await dry("9" * 5000)
        assert ok.status_code == 200 and json.loads(ok.text)["fits"] is False, ok.text
        for answer in (too_many, huge):
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "context", answer.text
            assert f"0..{MAX_CONTEXT_TOKENS}" in answer.json()["error"]["message"]
            assert len(answer.text) < 1000

    server.run(main())

