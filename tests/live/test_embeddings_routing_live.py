"""The routing signals on the embedding routes, read the way a router reads them.

An embedding model is loaded, queued and guarded like a chat model, so a router
must be able to treat it the same: `X-Memvisor-Max-Wait: 0` while the model is
still loading is a 503 `model_loading` with the load's progress (not a wait),
and an answer names the worker that computed it in `X-Memvisor-Worker`.
"""

from __future__ import annotations

import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config
from worker.main import LOAD_DELAY_ENV

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

NO_WAIT = {"x-memvisor-max-wait": "0"}
BODY = {"model": "emb", "input": ["routing signals"]}


@pytest.fixture
def live(tmp_path_factory, monkeypatch):
    from modelfiles.embedgen import make_embedding_model

    monkeypatch.setenv(LOAD_DELAY_ENV, "3.0")  # a load long enough to be refused during it
    folder = make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-embed", max_seq_length=32)
    config = make_config([ModelConfig(id="emb", path=str(folder))], host_name="edge-e")
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as server:
        yield server


def test_embeddings_honour_max_wait_during_a_load_and_name_the_worker(live):
    async def main():
        async with live.client() as c:
            refused = await c.post("/v1/embeddings", json=BODY, headers=NO_WAIT)
            ollama_refused = await c.post("/api/embed", json=BODY, headers=NO_WAIT)
            plain = await c.post("/v1/embeddings", json=BODY)  # no header: waits for the load
            again = await c.post("/v1/embeddings", json=BODY, headers=NO_WAIT)  # loaded: served at once
        return refused, ollama_refused, plain, again

    refused, ollama_refused, plain, again = live.run(main())
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_loading" and int(refused.headers["retry-after"]) >= 1
    assert error["progress"]["state"] in ("queued", "starting", "loading")
    assert ollama_refused.status_code == 503 and "error" in ollama_refused.json()
    assert refused.headers["x-memvisor-host"] == "edge-e"
    for served in (plain, again):
        assert served.status_code == 200, served.text
        assert len(served.json()["data"][0]["embedding"]) > 0
        assert served.headers["x-memvisor-host"] == "edge-e"
        assert served.headers["x-memvisor-worker"].startswith("emb")
