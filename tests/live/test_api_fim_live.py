"""Fill in the middle through a real supervisor and worker: `suffix` on
/v1/completions and on Ollama's /api/generate (the official client) works on a model whose
tokenizer has FIM tokens, as a folder and as a GGUF file, and is a 400 naming `suffix`,
refused before any load, on one without; /api/show's `insert` and the /v1/models card say
the same."""

from __future__ import annotations

import ollama
import openai
import pytest

from tests.test_gguf import write_gguf

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
