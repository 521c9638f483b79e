"""`/v1/completions` as lm-evaluation-harness's `local-completions` calls it, and Ollama's routes as
curl calls them, against a real supervisor and real workers (the tiny model, a tiny embedder).

lm-eval's request shapes (lm_eval/models/openai_completions.py `_create_payload`, api_models.py):
loglikelihood sends `{"model", "prompt": [[ids...], ...], "temperature": 0, "max_tokens": 1,
"logprobs": 1, "seed": 1234, "echo": true}` and reads `choices` sorted by `index`,
`logprobs.token_logprobs[ctxlen:-1]` and `top_logprobs[ctxlen:-1]`; generate_until sends
`{"prompt": [[ids...], ...], "model", "max_tokens", "temperature": 0, "stop": [...until, eos],
"seed": 1234}` and reads `choices[i].text` by `index`.
"""

from __future__ import annotations

import json

import openai
import pytest

from supervisor.config import ModelConfig
from tests.echo_harness import reference_logprobs
from tests.http_harness import LiveServer, make_config, parse_sse

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

CONTEXTS = ["The capital of France is", "Two plus two makes"]
ANSWERS = [" Paris, a city", " four and not five"]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from modelfiles.embedgen import make_embedding_model

    embedder = make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-embed", max_seq_length=32)
    models = [ModelConfig(id="a", path=str(tiny_models.a)), ModelConfig(id="tiny-embed", path=str(embedder))]
    with LiveServer(make_config(models, http="127.0.0.1:0"), tmp_path_factory.mktemp("rt")) as live:
        yield live


async def _tokens(client, text: str) -> list[int]:
    r = await client.post("/tokenize", json={"model": "a", "content": text, "add_special": True})
    return r.json()["tokens"]


def test_lm_eval_loglikelihood_requests_get_prompt_logprobs_equal_to_an_in_process_forward(server, tiny_models):
    """Several token-id prompts with echo, logprobs 1 and max_tokens 1 (lm-eval's own payload):
    one choice per prompt by index, the prompt's tokens and the one generated, the first prompt
    token's logprob null, each within 1e-3 of mlx_lm's forward pass; lm-eval's slice
    `token_logprobs[ctxlen:-1]` is the answer's tokens. Before: "Expected `str`, got `array`"."""

    async def main():
        async with server.client() as c:
            prompts = [await _tokens(c, q + a) for q, a in zip(CONTEXTS, ANSWERS)]
            ctxlens = [len(await _tokens(c, q)) for q in CONTEXTS]
            r = await c.post("/v1/completions", json={"model": "a", "prompt": prompts, "temperature": 0,
                                                      "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
            zero = await c.post("/v1/completions", json={"model": "a", "prompt": prompts[0], "max_tokens": 0,
                                                         "echo": True, "logprobs": 0})
        return prompts, ctxlens, r, zero

    prompts, ctxlens, r, zero = server.run(main(), timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = reference_logprobs(tiny_models.a, prompts)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    for choice in body["choices"]:
        i = choice["index"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompts[i]) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and len(lp["text_offset"]) == len(lp["tokens"])
        got = lp["token_logprobs"][1:len(prompts[i])]
        assert max(abs(a - b) for a, b in zip(got, expected[i])) < 1e-3, (got, expected[i])
        answer = lp["token_logprobs"][ctxlens[i]:-1]  # lm-eval's slice: the continuation's logprobs
        assert len(answer) == len(prompts[i]) - ctxlens[i]
        for token_lp, top in zip(answer, lp["top_logprobs"][ctxlens[i]:-1]):
            assert len(top) == 1 and max(top.values()) >= token_lp - 1e-6  # its is_greedy check reads these
        assert CONTEXTS[i] + ANSWERS[i] in choice["text"] and choice["finish_reason"] == "length"  # its ids decoded
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 2
    only = zero.json()["choices"][0]
    assert zero.json()["usage"]["completion_tokens"] == 0 and only["finish_reason"] == "length"
    assert len(only["logprobs"]["tokens"]) == len(prompts[0])
    assert max(abs(a - b) for a, b in zip(only["logprobs"]["token_logprobs"][1:], expected[0])) < 1e-3


def test_lm_eval_generate_until_requests_answer_each_prompt_as_alone(server):
    """generate_until: token-id prompts in one request, greedy, lm-eval's `until` list plus the EOS
    text as `stop` (five here, past OpenAI's four); each choice is the reply that prompt gets
    alone, by index. Before: "exactly one prompt per request"."""
    stops = ["\n\n", "Question:", "</s>", "<|im_end|>", "<|endoftext|>"]

    async def main():
        async with server.client() as c:
            prompts = [await _tokens(c, q) for q in CONTEXTS]
            batch = await c.post("/v1/completions", json={"model": "a", "prompt": prompts, "max_tokens": 8,
                                                          "temperature": 0, "stop": stops, "seed": 1234})
            alone = [await c.post("/v1/completions", json={"model": "a", "prompt": t, "max_tokens": 8,
                                                           "temperature": 0, "stop": stops, "seed": 1234})
                     for t in prompts]
            texts = await c.post("/v1/completions", json={"model": "a", "prompt": CONTEXTS, "max_tokens": 8,
                                                          "temperature": 0})
        return batch, alone, texts

    batch, alone, texts = server.run(main(), timeout=300)
    assert batch.status_code == 200, batch.text
    by_index = {c["index"]: c["text"] for c in batch.json()["choices"]}
    assert by_index == {i: r.json()["choices"][0]["text"] for i, r in enumerate(alone)}
    assert batch.json()["usage"]["completion_tokens"] == sum(r.json()["usage"]["completion_tokens"] for r in alone)
    assert [c["index"] for c in texts.json()["choices"]] == [0, 1]


def test_several_prompts_stream_interleaved_by_index_with_one_usage_and_one_done(server):
    """A streamed request of several prompts: each chunk names its choice's index (as OpenAI's
    do), one usage chunk at the end when asked, one [DONE]; the SDK reads it as ever."""

    async def main():
        client = server.openai()
        whole = await client.completions.create(model="a", prompt=CONTEXTS, max_tokens=6, temperature=0)
        chunks = [c async for c in await client.completions.create(
            model="a", prompt=CONTEXTS, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        async with server.client() as c:
            raw = await c.post("/v1/completions", json={"model": "a", "prompt": CONTEXTS, "max_tokens": 6,
                                                        "temperature": 0, "stream": True, "echo": True})
        return whole, chunks, raw

    whole, chunks, raw = server.run(main(), timeout=300)
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    events = parse_sse(raw.text)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    echoed: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            echoed[choice["index"]] = echoed.get(choice["index"], "") + choice["text"]
    assert echoed == {c.index: CONTEXTS[c.index] + c.text for c in whole.choices}


def test_the_openai_sdk_takes_token_prompts_echo_and_refusals(server):
    async def main():
        client = server.openai()
        ids = [1, 200, 300, 400]
        echoed = await client.completions.create(model="a", prompt=ids, max_tokens=0, echo=True, logprobs=2)
        errors = []
        for bad in ({"prompt": [[1, 2], [-5]]}, {"prompt": "x", "max_tokens": 0}, {"prompt": [10**9]}):
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="a", **bad)
            errors.append(err.value)
        return echoed, errors

    echoed, (negative, zero, outside) = server.run(main(), timeout=300)
    [choice] = echoed.choices
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 4
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:]) and choice.text
    assert negative.body["param"] == "prompt" and zero.body["param"] == "max_tokens"
    assert "outside" in outside.body["message"]  # the worker's check of its vocabulary


def test_ollama_curl_d_without_a_content_type_is_answered(server):
    """`curl http://localhost:11434/api/chat -d '{...}'` (Ollama's own docs) declares a form; Ollama
    answers it, and so does memvisor now: /api/chat, /api/generate, /api/embed with the real
    workers. A page sending the same is still refused."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    chat = {"model": "a", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
            "options": {"num_predict": 3}}

    async def main():
        async with server.client() as c:
            answers = [await c.post(path, content=json.dumps(body).encode(), headers=form) for path, body in (
                ("/api/chat", chat), ("/api/generate", {"model": "a", "prompt": "Hi", "options": {"num_predict": 3}}),
                ("/api/embed", {"model": "tiny-embed", "input": ["one", "two"]}))]
            page = await c.post("/api/chat", content=json.dumps(chat).encode(),
                                headers={**form, "Origin": "http://evil.example"})
        return answers, page

    (chat_r, generate_r, embed_r), page = server.run(main(), timeout=300)
    assert chat_r.status_code == 200 and chat_r.json()["done"] and chat_r.json()["message"]["role"] == "assistant"
    lines = [json.loads(line) for line in generate_r.text.splitlines()]
    assert generate_r.status_code == 200 and lines[-1]["done"] and lines[-1]["eval_count"] == 3
    assert embed_r.status_code == 200 and len(embed_r.json()["embeddings"]) == 2
    assert page.status_code == 403
