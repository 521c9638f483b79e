"""A pulled model answers: from the hub on loopback (tests/hub_harness.py) to a chat, with real workers.

Two roads, each through real processes: the Ollama client's `pull` then `chat`
on a supervisor's front door, and the terminal's `pull`, `chat` and `rm`
against a `serve` process (the CLI downloads in its own process and asks the
supervisor to reload; `rm` of a loaded model drains it through that reload).
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import ollama
import pytest

from tests.chat_harness import ROOT, Serving, cli_env
from tests.http_harness import make_config
from tests.hub_harness import FakeHub, pull_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with FakeHub() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield running


def test_ollama_client_pulls_then_the_model_answers_a_chat(hub, tiny_model, tmp_path):
    hub.add_folder("org/smol", tiny_model)
    with pull_server(make_config([]), tmp_path / "rt") as live:
        async def main():
            client = ollama.AsyncClient(host=live.url())
            progress = [line.status async for line in await client.pull("org/smol", stream=True)]
            reply = await client.chat(model="org/smol", messages=[{"role": "user", "content": "Hi"}],
                                      options={"num_predict": 5})
            return progress, reply, await client.ps()

        progress, reply, ps = live.run(main())
    assert progress[0] == "pulling manifest" and progress[-1] == "success"
    assert reply.done and reply.eval_count == 5 and reply.message.role == "assistant"
    assert [m.model for m in ps.models] == ["org/smol"]


def run_cli(serving: Serving, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args, "--runtime-dir", str(serving.runtime_dir)],
                          capture_output=True, text=True, cwd=ROOT, env=cli_env(**os.environ), timeout=300)


def test_terminal_pull_chat_and_rm_against_a_running_serve(hub, tiny_model, tmp_path):
    """`pull` serves the model at once (no restart, no config edit), `chat` answers, `rm` takes
    it out of the catalogue, stops its worker and deletes its snapshot."""
    hub.add_folder("org/terminal", tiny_model)
    toml = '[guard]\nhot_cache_max = 0\n[supervisor]\nhttp = "127.0.0.1:0"\n'
    with Serving(toml, tmp_path / "serve") as serving:
        pulled = run_cli(serving, "pull", "org/terminal")
        answered = run_cli(serving, "chat", "org/terminal", "Hello", "--max-tokens", "4")
        loaded = httpx.get(serving.url + "/api/ps").json()["models"]
        removed = run_cli(serving, "rm", "org/terminal")
        tags = httpx.get(serving.url + "/api/tags").json()["models"]
        ps = httpx.get(serving.url + "/api/ps").json()["models"]
    assert pulled.returncode == 0, pulled.stderr
    assert answered.returncode == 0 and answered.stdout.endswith("\n") and answered.stderr == "", answered.stderr
    assert [m["model"] for m in loaded] == ["org/terminal"]
    assert removed.returncode == 0 and "removed org/terminal" in removed.stdout, removed.stderr
    assert tags == [] and ps == []
    assert not (tmp_path / "hf" / "hub" / "models--org--terminal").exists()
