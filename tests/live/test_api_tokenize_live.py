"""The supervisor's end of a Tokenize when its worker dies before answering:
the waiting /tokenize gets a 503 `worker_exited` at once, not a hang until the timeout;
and an embedding model's worker refuses it by kind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from modelfiles.embedgen import make_embedding_model
    from supervisor.config import ModelConfig
    from tests.http_harness import LiveServer, make_config

    embedder = tmp_path_factory.mktemp("models") / "tiny-embed"
    make_embedding_model(embedder)
    models = [ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="e", path=str(embedder))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMVISOR_TEST_STEP_DELAY", "3")  # every step with work takes 3 s: a command waits
        with LiveServer(make_config(models), tmp_path_factory.mktemp("rt")) as live:
            yield live


def test_a_tokenize_waiting_on_a_worker_that_dies_is_a_503_at_once(server):
    async def main():
        stream = await server.openai().chat.completions.create(
            model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, stream=True)
        await stream.__anext__()  # the worker is decoding: each step sleeps first
        async with server.client() as h:
            pending = asyncio.ensure_future(h.post("/tokenize", json={"model": "a", "content": "hello"}))
            await asyncio.sleep(0.5)  # the command is in: it waits for the step to end
            os.kill(server.arbiter.pool.worker_for("a").pid, signal.SIGKILL)
            started = time.monotonic()
            answer = await pending
            waited = time.monotonic() - started
        await stream.close()
        return answer, waited

    answer, waited = server.run(main(), timeout=120)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "worker_exited"
    assert "Retry-After" in answer.headers
    assert waited < 30  # the exit ends the wait; the call's own timeout is step_timeout (300 s)


def test_an_embedding_models_worker_refuses_tokenize_by_kind(server):
    async def main():
        async with server.client() as h:
            return await h.post("/tokenize", json={"model": "e", "content": "hello"})

    answer = server.run(main(), timeout=120)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "wrong_model_kind"
