"""Fill in the middle through a real supervisor and worker: `suffix` on
/v1/completions and on Ollama's /api/generate (the official client) works on a model whose
tokenizer has FIM tokens, as a folder and as a GGUF file, and is a 400 naming `suffix`,
refused before any load, on one without; /api/show's `insert` and the /v1/models card say
the same."""

from __future__ import annotations

import ollama
import openai
import pytest

from tests.gguf_harness import write_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def server(fim_model, tiny_models, tmp_path_factory):
    from supervisor.config import ModelConfig
    from tests.http_harness import LiveServer, make_config

    gguf = tmp_path_factory.mktemp("gguf") / "fim.gguf"
    write_gguf(fim_model, gguf)
    models = [ModelConfig(id="fim", path=str(fim_model)), ModelConfig(id="a", path=str(tiny_models.a)),
              ModelConfig(id="fimgguf", path=str(gguf))]
    with pytest.MonkeyPatch.context() as patch:  # the GGUF is imported into this module's own cache
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        with LiveServer(make_config(models, load_timeout=300), tmp_path_factory.mktemp("rt")) as live:
            yield live


@pytest.fixture(scope="module")
def fim_prompt_tokens(fim_model) -> int:
    from mlx_lm.tokenizer_utils import load

    from worker import prompts

    return len(prompts.encode_fim(load(fim_model), PREFIX, SUFFIX))


@pytest.mark.parametrize("model", ["fim", "fimgguf"])
def test_completions_suffix_fills_in_the_middle_streamed_and_not(server, fim_prompt_tokens, model):
    kw = dict(model=model, prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0)

    async def main():
        client = server.openai()
        whole = await client.completions.create(**kw)
        chunks = [c async for c in await client.completions.create(stream=True, **kw)]
        return whole, chunks

    whole, chunks = server.run(main(), timeout=300)
    # the worker's prompt is BOS, <fim_prefix>, the prefix, <fim_suffix>, the suffix, <fim_middle>
    assert whole.usage.prompt_tokens == fim_prompt_tokens
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_suffix_on_a_model_without_fim_tokens_is_a_400_naming_suffix_before_any_load(server):
    async def main():
        with pytest.raises(openai.BadRequestError) as err:
            await server.openai().completions.create(model="a", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
        with pytest.raises(ollama.ResponseError) as refused:
            await ollama.AsyncClient(host=server.url()).generate(model="a", prompt=PREFIX, suffix=SUFFIX)
        return err.value, refused.value

    err, refused = server.run(main())
    assert err.body["param"] == "suffix" and "fill-in-the-middle" in err.body["message"]
    assert refused.status_code == 400 and "suffix" in refused.error
    assert server.arbiter.service.model_info("a").state == "unloaded"


def test_ollama_generate_suffix_with_the_official_client(server, fim_prompt_tokens):
    kw = dict(model="fim", prompt=PREFIX, suffix=SUFFIX, options={"num_predict": 4, "temperature": 0})

    async def main():
        client = ollama.AsyncClient(host=server.url())
        reply = await client.generate(**kw)
        parts = [part async for part in await client.generate(stream=True, **kw)]
        return reply, parts

    reply, parts = server.run(main())
    assert reply.done and reply.prompt_eval_count == fim_prompt_tokens
    assert "".join(part.response for part in parts) == reply.response


def test_insert_capability_and_model_cards_agree_with_what_is_served(server):
    names = ("fim", "fimgguf", "a")

    async def main():
        client = ollama.AsyncClient(host=server.url())
        listed = {m.id: m for m in (await server.openai().models.list()).data}
        return listed, {name: await client.show(name) for name in names}

    listed, shows = server.run(main())
    for model, fills in zip(names, (True, True, False)):
        shown = shows[model]
        assert ("insert" in shown.capabilities) is fills
        card = listed[model]
        assert set(card.capabilities) - {"chat"} == set(shown.capabilities)
        assert "chat" in card.capabilities and "completion" in card.capabilities
        assert card.context_length == shown.modelinfo["llama.context_length"] > 0


def _sse_objects(text: str) -> list[dict]:
    import json

    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def test_infill_as_llama_cpp_serves_it_equals_a_completion_with_that_suffix(server, fim_prompt_tokens):
    """/infill (llama.vim, llama.vscode): the prefix and the cursor's line before, the
    suffix after; the same greedy tokens as /v1/completions with `suffix`, whole and
    streamed, in llama.cpp's shape; the plugins' own knobs are taken and ignored."""
    line = "    "
    body = {"model": "fim", "input_prefix": PREFIX[: -len(line)], "prompt": line, "input_suffix": SUFFIX,
            "n_predict": 4, "temperature": 0, "samplers": ["top_k", "top_p"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4,
            "response_fields": ["content", "timings/prompt_n"]}

    async def main():
        completion = await server.openai().completions.create(model="fim", prompt=PREFIX, suffix=SUFFIX,
                                                              max_tokens=4, temperature=0)
        async with server.client() as h:
            whole = await h.post("/infill", json=body)
            streamed = await h.post("/infill", json={**body, "stream": True})
        return completion, whole, streamed

    completion, whole, streamed = server.run(main(), timeout=300)
    assert whole.status_code == 200, whole.text
    reply = whole.json()
    assert reply["content"] == completion.choices[0].text and reply["stop"] is True
    assert reply["tokens_evaluated"] == fim_prompt_tokens == completion.usage.prompt_tokens
    assert reply["tokens_predicted"] == completion.usage.completion_tokens
    assert reply["stop_type"] == ("limit" if completion.choices[0].finish_reason == "length" else "eos")
    events = _sse_objects(streamed.text)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == reply["content"]
    assert events[-1]["tokens_predicted"] == reply["tokens_predicted"]


def test_infill_input_extra_is_context_before_the_prefix(server):
    """llama.cpp's input_extra (other files) precedes the prefix: the prompt grows by
    exactly the extra text's tokens."""
    extra = "def sub(a, b):\n    return a - b\n\n"
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 1, "temperature": 0, "model": "fim"}

    async def main():
        async with server.client() as h:
            plain = await h.post("/infill", json=body)
            more = await h.post("/infill", json={**body, "input_extra": [{"filename": "sub.py", "text": extra}]})
            counted = await h.post("/tokenize", json={"model": "fim", "content": extra})
        return plain.json(), more.json(), counted.json()

    plain, more, counted = server.run(main(), timeout=300)
    grew = more["tokens_evaluated"] - plain["tokens_evaluated"]
    assert 0 < grew and abs(grew - len(counted["tokens"])) <= 1  # one merge across the seam at most


def test_infill_refusals_name_the_field_before_any_load(server):
    """llama.cpp's own test_invalid_input_extra_req cases, an unknown field, and a model
    without FIM tokens: each a 400 naming what to fix; the non-FIM model stays unloaded."""
    base = {"model": "a", "input_prefix": PREFIX, "input_suffix": SUFFIX}
    bad_extras = [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                  {"filename": 123, "text": 456}]

    async def main():
        async with server.client() as h:
            extras = [await h.post("/infill", json={**base, "model": "fim", "input_extra": [x]}) for x in bad_extras]
            unknown = await h.post("/infill", json={**base, "model": "fim", "n_probs": 3})
            no_fim = await h.post("/infill", json=base)
        return extras, unknown, no_fim

    extras, unknown, no_fim = server.run(main())
    for r in extras:
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("input_extra"), r.text
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "n_probs"
    assert no_fim.status_code == 400 and no_fim.json()["error"]["param"] == "input_suffix"
    assert "fill-in-the-middle" in no_fim.json()["error"]["message"]
    assert server.arbiter.service.model_info("a").state == "unloaded"
