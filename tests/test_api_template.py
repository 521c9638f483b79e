"""Tools reach the model through its chat template, or in words when the template
has no place for them (the engine's prompt, a real tokenizer, no generation)."""

from __future__ import annotations

import json
import shutil

import pytest

from shared import protocol as p
from worker.engine import Engine

TOOLS = json.dumps([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                      "parameters": {"type": "object"}}}])
CALL = json.dumps([{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}])
HISTORY = [p.ChatMessage(role="user", content="Weather?"),
           p.ChatMessage(role="assistant", content="", tool_calls=CALL),
           p.ChatMessage(role="tool", content="sunny", tool_call_id="c1")]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """The demo model (its template renders tools) and a copy whose template knows nothing of them."""
    copy = tmp_path_factory.mktemp("plain") / "m"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return Engine.load(tiny_model, own_usage_fn=lambda: 0), Engine.load(copy, own_usage_fn=lambda: 0)


@pytest.mark.parametrize("which", [0, 1], ids=["template-renders-tools", "template-without-tools"])
def test_tools_and_tool_turns_reach_the_prompt(engines, which):
    engine = engines[which]
    text = engine.tokenizer.decode(engine.encode_chat(HISTORY, TOOLS))
    assert '"name": "get_weather"' in text and "<tool_call>" in text  # the tool list and the earlier call
    assert '{"city": "Oslo"}' in text and "sunny" in text
    assert text.index("get_weather") < text.index("Weather?")  # tools first, as a system turn
    plain = engine.tokenizer.decode(engine.encode_chat(HISTORY[:1]))
    assert "get_weather" not in plain
