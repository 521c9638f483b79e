"""The HTTP front door around a stub supervisor, and the checks its test modules share (no tests here)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import anthropic
import httpx
import openai

from supervisor.config import Config, ModelConfig, SupervisorConfig
from supervisor.doors.refusals import LoadError
from supervisor.guard.readiness import Health
from supervisor.http.server import start_http
from supervisor.workers.streams import RequestStream, new_request_id


def fake_huge_model(root: Path, claimed_bytes: int) -> Path:
    """A model directory whose safetensors header claims `claimed_bytes` of weights.

    Admission sizes a model from its headers before spawning anything (SPEC
    A2), so this is refused exactly as a real model that large would be.
    """
    root.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F16", "shape": [claimed_bytes // 2], "data_offsets": [0, claimed_bytes]}})
    raw = header.encode()
    (root / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    (root / "config.json").write_text("{}")
    return root


def assert_openai_error(response, status: int, code: str | None = None) -> dict:
    """The one error shape every failure has (and no traceback in it)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


MSG = [{"role": "user", "content": "hi"}]


class StubSupervisor:
    """What the front door needs of the arbiter; `generate` does what the test says."""

    def __init__(self, outcome, **scfg) -> None:
        self.outcome = outcome
        self.config = Config(supervisor=SupervisorConfig(http="127.0.0.1:0", **scfg), models=[ModelConfig(id="m", path="/nonexistent")])
        self.kept: list[float] = []

    def model_config(self, model_id):
        return self.config.models[0]

    async def generate(self, model_id, gen, max_wait=None):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        gen.request_id = gen.request_id or new_request_id()  # as the supervisor does
        stream = RequestStream(gen.request_id, model_id, "m#1")
        for msg in self.outcome(gen.request_id):
            stream.put(msg)  # as the pool delivers them: a Prompted is held, the rest queued
        return stream

    def cancel(self, stream, reason=""):
        pass

    def keep_alive(self, model_id, seconds):
        self.kept.append(seconds)

    def model_info(self, model_id):
        raise LoadError("no info in the stub", http_status=404)

    def health(self):
        return Health(status="ok", waiting={})  # its one model is not pinned

    def add_event_hook(self, hook):
        pass


@contextlib.asynccontextmanager
async def serving(sup):
    """The real front door (uvicorn, real HTTP) around the stub, and the three clients."""
    server, address = await start_http(sup)
    url = f"http://{address}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            yield (http, openai.AsyncOpenAI(base_url=url + "/v1", api_key="k1", max_retries=0),
                   anthropic.AsyncAnthropic(base_url=url, api_key="k1", max_retries=0))
    finally:
        server.should_exit = True
        await server.task
