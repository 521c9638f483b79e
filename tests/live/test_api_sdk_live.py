"""The Anthropic Messages API and OpenAI's Responses API with the real SDKs
(anthropic's messages.create / messages.stream, openai's responses.create) against a real
supervisor and a real worker. The demo model's weights are random: what is asserted of
its output is what the template, the stream and constrained decoding guarantee.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

# `server` (the tiny model as "a") and no_front_door_errors are conftest.py's
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


def test_anthropic_create_with_system_multi_turn_and_max_tokens(server):
    async def main():
        client = server.anthropic()
        return await client.messages.create(
            model="a", max_tokens=6, system="Be brief.", extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": [{"type": "text", "text": "Tell me more."}]}])

    m = server.run(main())
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and m.usage.input_tokens > 10
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text


def test_anthropic_stream_follows_the_event_sequence_and_matches_create(server):
    kw = dict(model="a", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0})

    async def main():
        client = server.anthropic()
        whole = await client.messages.create(**kw)
        async with client.messages.stream(**kw) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        return whole, kinds, final

    whole, kinds, final = server.run(main())
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text  # greedy: the same tokens
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_anthropic_tool_use_named_validates_and_tool_result_is_accepted(server):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]

    async def main():
        client = server.anthropic()
        # One call, greedy, room to close it: sampled, the random model's arguments could run past
        # a small budget (JSON whitespace is free) and end max_tokens, 1 run in 5 here.
        first = await client.messages.create(
            model="a", max_tokens=200, tools=tools, extra_body={"temperature": 0},
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "Weather in Oslo?"}])
        use = first.content[-1]
        follow = [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                     "input": use.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        async with client.messages.stream(model="a", max_tokens=200, tools=tools, extra_body={"temperature": 0},
                                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                          messages=follow) as stream:
            streamed = await stream.get_final_message()
        return first, streamed

    first, streamed = server.run(main())
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].type == "tool_use"
    jsonschema.validate(streamed.content[-1].input, WEATHER)


def test_responses_create_with_text_and_with_messages_and_instructions(server):
    async def main():
        client = server.openai()
        plain = await client.responses.create(model="a", input="Hello", max_output_tokens=5, temperature=0)
        items = await client.responses.create(
            model="a", instructions="Be brief.", max_output_tokens=5, temperature=0,
            input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": [{"type": "input_text", "text": "More"}]}])
        return plain, items

    plain, items = server.run(main())
    for r in (plain, items):
        assert r.object == "response" and r.id.startswith("resp_") and r.output_text
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 5
    assert items.usage.input_tokens > plain.usage.input_tokens


def test_responses_stream_events_and_text_equal_create(server):
    kw = dict(model="a", input="Hello", max_output_tokens=8, temperature=0)

    async def main():
        client = server.openai()
        whole = await client.responses.create(**kw)
        events = [e async for e in await client.responses.create(stream=True, **kw)]
        return whole, events

    whole, events = server.run(main())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_item.added" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_tool_required_streamed_and_json_schema_text(server):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]

    async def main():
        client = server.openai()
        called = await client.responses.create(model="a", input="Weather?", tools=tools, tool_choice="required",
                                               max_output_tokens=60)
        events = [e async for e in await client.responses.create(
            model="a", input="Weather?", tools=tools, max_output_tokens=200, stream=True, parallel_tool_calls=False,
            temperature=0,  # greedy: a sampled string argument could run past the budget (incomplete)
            tool_choice={"type": "function", "name": "get_weather"})]  # exactly one call, as asserted below
        shaped = await client.responses.create(model="a", input="Weather?", max_output_tokens=60, text={
            "format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
        return called, events, shaped

    called, events, shaped = server.run(main())
    # required, parallel allowed: one or more calls; a random model may keep calling until
    # max_output_tokens, and then the whole calls before the cut are returned (incomplete)
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and called.status in ("completed", "incomplete")
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)
    assert events[-1].type == "response.completed"
    jsonschema.validate(json.loads(shaped.output_text), WEATHER)


def test_anthropic_stop_sequences_end_with_stop_reason_stop_sequence(server):
    """Greedy, so the second reply repeats the first until the stop taken from it."""
    kw = dict(model="a", messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0})

    async def main():
        client = server.anthropic()
        free = await client.messages.create(max_tokens=24, **kw)
        text = free.content[0].text
        words = text.split()
        stop = words[len(words) // 2][:3] if words else text[len(text) // 2:][:2]
        stopped = await client.messages.create(max_tokens=24, stop_sequences=[stop], **kw)
        async with client.messages.stream(max_tokens=24, stop_sequences=[stop], **kw) as s:
            streamed = await s.get_final_message()
        return text, stop, stopped, streamed

    text, stop, stopped, streamed = server.run(main())
    assert stop and stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[:text.index(stop)]
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
