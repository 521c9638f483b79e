"""Tools and structured output on /v1/chat/completions with the real openai SDK against a real supervisor:
tool calls (named, required, auto; streamed and not), structured output, keep_alive.

The demo model has random weights, so what it says is noise: whatever is
asserted about its output is what constrained decoding guarantees.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.http_harness import until

# `server` (the tiny model as "a") and no_front_door_errors are conftest.py's
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_named_tool_choice_returns_a_call_that_validates_against_its_schema(server):
    async def main():
        return await server.openai().chat.completions.create(
            model="a", messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, seed=3,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})

    r = server.run(main())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_streams_delta_tool_calls(server):
    async def main():
        stream = await server.openai().chat.completions.create(
            model="a", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=80, temperature=1.0, seed=5, stream=True)
        return [c async for c in stream]

    chunks = server.run(main())
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_tool_results_in_the_history_go_through_the_template(server):
    """role "tool" with tool_call_id after an assistant turn with tool_calls; tool_choice none."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]

    async def main():
        client = server.openai()
        after = await client.chat.completions.create(model="a", messages=history, tools=TOOLS, tool_choice="none",
                                                     max_tokens=5, temperature=0)
        without = await client.chat.completions.create(model="a", messages=ASK, max_tokens=5, temperature=0)
        withtools = await client.chat.completions.create(model="a", messages=ASK, tools=TOOLS, tool_choice="none",
                                                         max_tokens=5, temperature=0)
        return after, without, withtools

    after, without, withtools = server.run(main())
    assert after.choices[0].finish_reason == "length" and after.choices[0].message.tool_calls is None
    # the tools and the history reached the model: the prompts are longer by their rendering
    assert withtools.usage.prompt_tokens > without.usage.prompt_tokens + 20
    assert after.usage.prompt_tokens > withtools.usage.prompt_tokens + 20


def test_auto_tool_choice_returns_text_when_the_model_does_not_open_with_a_call(server):
    async def main():
        return await server.openai().chat.completions.create(
            model="a", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)

    r = server.run(main())
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


def test_json_schema_response_format_validates_20_of_20(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def main():
        client = server.openai()
        return [await client.chat.completions.create(model="a", messages=[{"role": "user", "content": f"Person {i}"}],
                                                     response_format=fmt, max_tokens=60, temperature=1.0, seed=i)
                for i in range(20)]

    replies = server.run(main(), timeout=300)
    for r in replies:
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert sum(r.choices[0].finish_reason == "stop" for r in replies) == 20


def test_json_object_response_format_streams_one_object(server):
    async def main():
        stream = await server.openai().chat.completions.create(
            model="a", messages=ASK, response_format={"type": "json_object"}, max_tokens=40, temperature=1.0,
            seed=1, stream=True)
        return [c async for c in stream]

    chunks = server.run(main())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_refused_fields_are_400s_naming_them_through_the_sdk(server):
    async def main():
        client = server.openai()
        errors = []
        for kw in ({"n": 2}, {"extra_body": {"typical_p": 0.5}}, {"store": True}):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="a", messages=ASK, max_tokens=2, **kw)
            errors.append(err.value)
        return errors

    errors = server.run(main())
    assert [e.body["param"] for e in errors] == ["n", "typical_p", "store"]
    assert all(e.status_code == 400 and e.body["type"] == "invalid_request_error" for e in errors)


def test_keep_alive_zero_unloads_after_the_request_and_ttl_shows_in_status(server):
    async def main():
        client = server.openai()
        await client.chat.completions.create(model="a", messages=ASK, max_tokens=2, extra_body={"ttl": 900})
        async with server.client() as c:
            card = (await c.get("/v1/models/a")).json()
        await client.chat.completions.create(model="a", messages=ASK, max_tokens=2, extra_body={"keep_alive": 0})
        await until(lambda: server.arbiter.pool.worker_for("a") is None, timeout=20, what="unloaded by keep_alive 0")
        return card

    card = server.run(main())
    assert card["memvisor"]["ttl"] == 900 and 0 < card["memvisor"]["expires_in"] <= 900
