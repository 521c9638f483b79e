"""The Ollama API with the official `ollama` Python client (and raw HTTP where
the wire itself is the point) against a real supervisor and a real worker. The tiny
model's weights are random: what is asserted is what the API, the stream and the
template guarantee, not what the model says."""

from __future__ import annotations

import json
from pathlib import Path

import ollama
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]


def client(server) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=server.url())


def test_ollama_version_tags_and_show_describe_the_model(server):
    async def main():
        c = client(server)
        async with server.client() as h:
            version = (await h.get("/api/version")).json()
        return version, await c.list(), await c.show("a"), await c.show("a:latest")

    version, tags, shown, latest = server.run(main())
    major, minor, patch = (int(x) for x in version["version"].split("."))
    assert (major, minor, patch) >= (0, 6, 4)
    [entry] = tags.models
    assert entry.model == "a" and entry.size > 0 and len(entry.digest) == 64
    assert entry.details.format == "safetensors" and entry.details.family == "llama"
    assert entry.details.quantization_level == "F16" and entry.details.parameter_size
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] > 0 and shown.template
    assert latest.modelinfo == shown.modelinfo


def test_ollama_chat_streamed_and_whole_agree_greedy(server):
    kw = dict(model="a", messages=[{"role": "user", "content": "Hi"}], options={"temperature": 0, "num_predict": 6})

    async def main():
        c = client(server)
        whole = await c.chat(**kw)
        parts = [part async for part in await c.chat(stream=True, **kw)]
        return whole, parts

    whole, parts = server.run(main())
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    assert whole.message.role == "assistant" and whole.message.content
    assert all(not part.done for part in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert parts[-1].eval_count == 6 and parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_ollama_generate_streams_ndjson_and_format_json_is_json(server):
    async def main():
        c = client(server)
        async with server.client() as h:
            raw = await h.post("/api/generate", json={"model": "a", "prompt": "Hi",
                                                      "options": {"temperature": 0, "num_predict": 4}})
        shaped = await c.generate(model="a", prompt="Give JSON", format="json", options={"num_predict": 40})
        return raw, shaped

    raw, shaped = server.run(main())
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.text.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4 and "response" in lines[0]
    assert shaped.done
    if shaped.done_reason == "stop":  # a constrained reply that ended is whole JSON
        assert isinstance(json.loads(shaped.response), dict)


def test_ollama_unknown_model_is_404_and_unhonoured_option_400(server):
    async def main():
        c = client(server)
        errors = []
        for call in (c.chat(model="nope", messages=[{"role": "user", "content": "Hi"}]),
                     c.chat(model="a", messages=[{"role": "user", "content": "Hi"}], options={"mirostat": 1})):
            try:
                await call
            except ollama.ResponseError as exc:
                errors.append(exc)
        return errors

    missing, refused = server.run(main())
    assert missing.status_code == 404 and "nope" in missing.error
    assert refused.status_code == 400 and "options.mirostat" in refused.error


def test_ollama_ps_lists_the_loaded_model_with_expiry(server):
    """`size` is the weight files' size, the same in /api/tags and /api/ps and after work (it was
    the worker's memory, which grows); no TTL is Ollama's keep_alive -1: now + Go's longest
    duration, year 2300 or so."""
    async def main():
        c = client(server)
        await c.generate(model="a", prompt="Hi", options={"num_predict": 1})
        first = await c.ps()
        await c.generate(model="a", prompt="Hi " * 50, options={"num_predict": 16})
        return first, await c.ps(), await c.list()

    first, later, tags = server.run(main())
    [entry] = first.models
    weights = sum(f.stat().st_size for f in Path(server.arbiter.config.models[0].path).glob("model*.safetensors"))
    assert entry.model == "a" and entry.size == weights == later.models[0].size == tags.models[0].size
    assert entry.size_vram in (0, entry.size) and entry.expires_at.year > 2300
    assert entry.details.parameter_size and entry.details.quantization_level == "F16"


def test_ollama_empty_request_loads_and_keep_alive_zero_unloads(server):
    """Open WebUI preloads with an empty request and unloads with keep_alive 0, as Ollama defines."""
    async def main():
        c = client(server)
        loaded = await c.generate(model="a")
        ps_loaded = await c.ps()
        unloaded = await c.chat(model="a", messages=[], keep_alive=0)
        return loaded, ps_loaded, unloaded, await c.ps()

    loaded, ps_loaded, unloaded, ps_after = server.run(main())
    assert loaded.done and loaded.done_reason == "load" and [m.model for m in ps_loaded.models] == ["a"]
    assert unloaded.done and unloaded.done_reason == "unload" and ps_after.models == []


def test_ollama_pull_of_a_bare_ollama_name_says_a_hub_repo_is_needed(server):
    """`ollama pull llama3` names Ollama's own library, which memvisor has not: a 400 that says
    to give a Hugging Face repo (pulls themselves: tests/test_models_pull.py)."""
    async def main():
        try:
            await client(server).pull("llama3")
        except ollama.ResponseError as exc:
            return exc

    refused = server.run(main())
    assert refused.status_code == 400 and "ORG/NAME" in refused.error
