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
def server(tiny_models, tmp_path_factory):
    """`tiny_models` first: the session's tokenizer is trained before any live supervisor runs in
    this process (training one after can deadlock on a leaked ZeroMQ context)."""
    smol = fetch_smollm2()
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
