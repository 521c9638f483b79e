"""A required tool call cut by max_tokens (found by llama.cpp's server suite): the
reply is the call list and nothing else. With no call closed before the cut it is an empty,
well-formed answer (`tool_calls: []`, finish_reason "length"; Anthropic: no block and
stop_reason "max_tokens"; Responses: no output item and status "incomplete"), never the
partial JSON as text; the calls completed before the cut are returned.

The worker's output is given exactly (the real front door over HTTP, the SDKs as clients,
a stub supervisor that feeds a real RequestStream as the pool does), so each cut lands
where the test says; tests/live/test_api_llamacpp_findings_live.py cuts a real worker's reply.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from shared import protocol as p
from tests.frontdoor_harness import MSG, StubSupervisor, serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
NONE_CLOSED = ['[{"name": "get_weather", ', '"arguments": {"ci']
ONE_CLOSED = ['[{"name": "get_weather", "arguments": {"city": "Oslo"}}', ', {"name": "get_weather", "argu']


def cut(pieces: list[str]):
    def outcome(rid):
        return [p.TokenOut(request_id=rid, text=t) for t in pieces] + [
            p.Finished(request_id=rid, finish_reason="length", prompt_tokens=7, completion_tokens=len(pieces))]
    return outcome


def replies(pieces: list[str]):
    """Every API's answer to a required call whose worker reply was `pieces`, then cut."""
    async def main():
        async with serving(StubSupervisor(cut(pieces))) as (_, oa, an):
            chat = dict(model="m", messages=MSG, tools=CHAT_TOOLS, max_tokens=9)
            out = {
                "chat": await oa.chat.completions.create(tool_choice="required", **chat),
                "chat_named": await oa.chat.completions.create(
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}, **chat),
                "chat_stream": [c async for c in await oa.chat.completions.create(
                    tool_choice="required", stream=True, **chat)],
            }
            anth = dict(model="m", max_tokens=9, messages=MSG, tools=ANTHROPIC_TOOLS)
            out["anthropic"] = await an.messages.create(tool_choice={"type": "any"}, **anth)
            async with an.messages.stream(tool_choice={"type": "tool", "name": "get_weather"}, **anth) as s:
                out["anthropic_events"] = [e async for e in s]
                out["anthropic_stream"] = await s.get_final_message()
            resp = dict(model="m", input="Weather?", tools=RESPONSES_TOOLS, max_output_tokens=9,
                        tool_choice="required")
            out["responses"] = await oa.responses.create(**resp)
            out["responses_stream"] = [e async for e in await oa.responses.create(stream=True, **resp)]
        return out

    return asyncio.run(main())


@pytest.fixture(scope="module")
def none_closed():
    return replies(NONE_CLOSED)


@pytest.fixture(scope="module")
def one_closed():
    return replies(ONE_CLOSED)


def _stream_text_and_calls(chunks) -> tuple[str, list]:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    return text, calls


@pytest.mark.parametrize("key", ["chat", "chat_named"])
def test_cut_required_call_with_none_closed_is_an_empty_tool_calls_answer_with_finish_length(none_closed, key):
    choice = none_closed[key].choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls == [] and choice.message.content is None


def test_cut_required_call_streamed_sends_no_text_and_no_call_then_finish_length(none_closed):
    chunks = none_closed["chat_stream"]
    text, calls = _stream_text_and_calls(chunks)
    assert text == "" and calls == []
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cut_anthropic_any_and_tool_have_no_block_and_stop_reason_max_tokens(none_closed):
    for message in (none_closed["anthropic"], none_closed["anthropic_stream"]):
        assert message.stop_reason == "max_tokens" and message.content == []
    kinds = [e.type for e in none_closed["anthropic_events"]]
    assert "content_block_start" not in kinds and kinds[-1] == "message_stop"


def test_cut_responses_required_has_no_output_and_status_incomplete(none_closed):
    whole = none_closed["responses"]
    assert whole.status == "incomplete" and whole.output == []
    assert whole.incomplete_details.reason == "max_output_tokens"
    events = none_closed["responses_stream"]
    assert events[-1].type == "response.incomplete" and events[-1].response.output == []
    assert not any(e.type.startswith("response.output") for e in events)


def test_cut_required_calls_completed_before_the_cut_are_returned_on_every_api(one_closed):
    city = {"city": "Oslo"}
    for key in ("chat", "chat_named"):
        choice = one_closed[key].choices[0]
        [call] = choice.message.tool_calls
        assert json.loads(call.function.arguments) == city and choice.finish_reason == "length"
        assert choice.message.content is None
    text, calls = _stream_text_and_calls(one_closed["chat_stream"])
    assert text == "" and [json.loads(c.function.arguments) for c in calls] == [city]
    for message in (one_closed["anthropic"], one_closed["anthropic_stream"]):
        assert [b.type for b in message.content] == ["tool_use"] and message.content[0].input == city
        assert message.stop_reason == "max_tokens"
    for response in (one_closed["responses"], one_closed["responses_stream"][-1].response):
        assert [o.type for o in response.output] == ["function_call"] and response.status == "incomplete"
        assert json.loads(response.output[0].arguments) == city


# `tool_choice: auto`: the model opened a call (Hermes/Qwen `<tool_call>` tags) and max_tokens cut it.
AUTO_NONE_CLOSED = ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"ci']
AUTO_ONE_CLOSED = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
                   '<tool_call>\n{"name": "get_we']


def auto_replies(pieces: list[str]):
    async def main():
        async with serving(StubSupervisor(cut(pieces))) as (_, oa, an):
            chat = dict(model="m", messages=MSG, tools=CHAT_TOOLS, max_tokens=9)
            out = {"chat": await oa.chat.completions.create(**chat),
                   "chat_stream": [c async for c in await oa.chat.completions.create(stream=True, **chat)]}
            out["anthropic"] = await an.messages.create(model="m", max_tokens=9, messages=MSG, tools=ANTHROPIC_TOOLS)
            out["responses"] = await oa.responses.create(model="m", input="Weather?", tools=RESPONSES_TOOLS,
                                                         max_output_tokens=9)
        return out

    return asyncio.run(main())


def test_cut_auto_call_with_none_closed_returns_no_half_call_as_text_on_every_api():
    out = auto_replies(AUTO_NONE_CLOSED)
    choice = out["chat"].choices[0]
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls
    text, calls = _stream_text_and_calls(out["chat_stream"])
    assert text == "" and calls == [] and out["chat_stream"][-1].choices[0].finish_reason == "length"
    assert out["anthropic"].stop_reason == "max_tokens"
    assert all(b.type != "text" or not b.text for b in out["anthropic"].content)
    assert out["responses"].status == "incomplete"
    assert out["responses"].output_text == "" and "<tool_call>" not in json.dumps(out["responses"].model_dump())


def test_cut_auto_calls_completed_before_the_cut_are_returned_without_the_half_one():
    out = auto_replies(AUTO_ONE_CLOSED)
    choice = out["chat"].choices[0]
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"} and choice.finish_reason == "length"
    assert not choice.message.content
    text, calls = _stream_text_and_calls(out["chat_stream"])
    assert text == "" and [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}]
    assert [b.type for b in out["anthropic"].content] == ["tool_use"]
    assert [o.type for o in out["responses"].output] == ["function_call"]


def test_cut_auto_reply_of_whitespace_or_plain_text_stays_content():
    """Only an opened call is dropped: a reply cut before it said anything but blank lines
    (a random-weight model's) or plain words keeps its text."""
    for pieces in (["\n\n", "\n"], ["It is ", "sunny"], ["<tool", "s are fun"]):
        choice = auto_replies(pieces)["chat"].choices[0]
        assert choice.message.content == "".join(pieces) and choice.finish_reason == "length"


def test_cut_auto_reply_inside_the_opening_tag_is_dropped():
    choice = auto_replies(["  <tool_", "ca"])["chat"].choices[0]
    assert not choice.message.content and not choice.message.tool_calls and choice.finish_reason == "length"
