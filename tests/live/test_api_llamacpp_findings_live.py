"""What llama.cpp's server test suite found, pointed at memvisor, each pinned
against a real supervisor and worker: Anthropic's streamed message_start carried
input_tokens 0, /v1/messages/count_tokens was a 404, clients that leave out /v1 got
404s, and the model card had no context length."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

HI = [{"role": "user", "content": "Hi"}]


def test_anthropic_message_start_reports_real_input_tokens(server):
    async def main():
        client = server.anthropic()
        whole = await client.messages.create(model="a", max_tokens=3, messages=HI)
        async with client.messages.stream(model="a", max_tokens=3, messages=HI) as stream:
            start = [e async for e in stream if e.type == "message_start"]
        return whole, start

    whole, [start] = server.run(main())
    assert whole.usage.input_tokens > 0
    assert start.message.usage.input_tokens == whole.usage.input_tokens


def test_anthropic_count_tokens_matches_the_messages_usage(server):
    async def main():
        client = server.anthropic()
        counted = await client.messages.count_tokens(model="a", messages=HI, system="Be brief.")
        whole = await client.messages.create(model="a", max_tokens=2, messages=HI, system="Be brief.")
        async with server.client() as h:
            unknown = await h.post("/v1/messages/count_tokens", json={"model": "nope", "messages": HI})
        return counted, whole, unknown

    counted, whole, unknown = server.run(main())
    assert counted.input_tokens == whole.usage.input_tokens > 0
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"


def test_routes_without_v1_prefix_reach_the_same_handlers(server):
    chat = {"model": "a", "messages": HI, "max_tokens": 2}

    async def main():
        async with server.client() as h:
            return (await h.get("/models"), await h.post("/chat/completions", json=chat),
                    await h.post("/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 2}),
                    await h.post("/messages", json=chat))

    models, completion, text, message = server.run(main())
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "a"
    assert completion.status_code == 200 and completion.json()["object"] == "chat.completion"
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    assert message.status_code == 200 and message.json()["type"] == "message"


def test_model_card_carries_context_length(server):
    async def main():
        client = server.openai()
        listed = await client.models.list()
        one = await client.models.retrieve("a")
        return listed, one

    listed, one = server.run(main())
    assert listed.data[0].context_length == one.context_length > 0


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_cut_required_tool_call_from_a_real_worker_is_an_empty_tool_calls_answer(server):
    """A real worker's call list cut after 3 tokens (no call can close that soon): finish
    "length" and no calls, streamed or not; never the partial JSON as content."""
    kw = dict(model="a", messages=HI, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=3, temperature=0)

    async def main():
        client = server.openai()
        whole = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
        anth = await server.anthropic().messages.create(
            model="a", max_tokens=3, messages=HI, tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}])
        return whole, chunks, anth

    whole, chunks, anth = server.run(main())
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 3
    assert choice.message.tool_calls == [] and choice.message.content is None
    assert not any(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert anth.stop_reason == "max_tokens" and anth.content == []


TEXT = "What is the capital of France? 媽 🤗"


def test_tokenize_and_detokenize_through_the_worker_as_llama_cpp_has_them(server):
    """/tokenize and /detokenize from the HTTP client to the worker's tokenizer and back."""
    async def main():
        async with server.client() as h:
            plain = await h.post("/tokenize", json={"content": TEXT})
            bos = await h.post("/tokenize", json={"model": "a", "content": TEXT, "add_special": True})
            pieces = await h.post("/tokenize", json={"content": TEXT, "with_pieces": True})
            back = await h.post("/detokenize", json={"tokens": plain.json()["tokens"]})
        return plain, bos, pieces, back

    plain, bos, pieces, back = server.run(main())
    assert plain.status_code == bos.status_code == pieces.status_code == back.status_code == 200
    ids = plain.json()["tokens"]
    assert len(ids) > 5 and all(isinstance(t, int) for t in ids)
    assert bos.json()["tokens"][1:] == ids and bos.json()["tokens"][0] not in ids[:1]
    entries = pieces.json()["tokens"]
    assert [e["id"] for e in entries] == ids
    raw = b"".join(e["piece"].encode() if isinstance(e["piece"], str) else bytes(e["piece"]) for e in entries)
    assert raw == TEXT.encode() and any(isinstance(e["piece"], list) for e in entries)
    assert back.json() == {"content": TEXT}


def test_tokenize_messages_counts_what_the_chat_completion_reports(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]

    async def main():
        async with server.client() as h:
            counted = await h.post("/tokenize", json={"model": "a", "messages": messages})
        done = await server.openai().chat.completions.create(model="a", messages=messages, max_tokens=1)
        return counted, done

    counted, done = server.run(main())
    assert counted.status_code == 200, counted.text
    assert len(counted.json()["tokens"]) == done.usage.prompt_tokens > 0


def test_tokenize_refusals_name_the_field_in_openais_shape(server):
    async def main():
        async with server.client() as h:
            return (await h.post("/tokenize", json={"model": "nope", "content": "x"}),
                    await h.post("/tokenize", json={"model": "a"}),
                    await h.post("/detokenize", json={"model": "a", "tokens": [1, 10**9]}),
                    await h.post("/tokenize", json={"content": "x", "n_probs": 2}),
                    await h.post("/detokenize", json={"tokens": [10**20]}))

    unknown, empty, bad_id, unknown_field, huge = server.run(main())
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "content"
    assert bad_id.status_code == 400 and "1000000000" in bad_id.json()["error"]["message"]
    assert unknown_field.status_code == 400 and unknown_field.json()["error"]["param"] == "n_probs"
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "tokens[0]"
