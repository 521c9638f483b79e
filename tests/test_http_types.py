"""The front door's request decoding and error mapping, as pure functions.

These pin what a client sees for bad input (the field path, the status) and
how a request becomes a worker's `Generate`, without a server.
"""

from __future__ import annotations

import msgspec
import pytest

from shared import protocol as p
from supervisor.http.auth import is_loopback_client
from supervisor.http.completions import completion_generates
from supervisor.http.errors import from_failed
from supervisor.http.openai import chat_generate
from supervisor.http.openai_types import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    BodyError,
    ChatRequest,
    CompletionRequest,
    GuardSettingsIn,
    decode_body,
)
from supervisor.http.server import endpoint_label


def chat(**fields) -> ChatRequest:
    fields.setdefault("model", "m")
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return decode_body(msgspec.json.encode(fields), ChatRequest)


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content", "Expected `str"),
        (b'{"model": "m", "messages": [], "max_tokens": "ten"}', "max_tokens", "Expected `int | null`, got `str`"),
        (b'{"model": "m", "messages": [], "temperature": 3}', "temperature", "<= 2.0"),
        (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", "Invalid enum"),
        (b'{"messages": []}', None, "missing required field `model`"),
        (b'[1, 2]', None, "Expected `object`, got `array`"),
    ],
)
def test_wrong_types_are_400_with_the_field_path(body, param, words):
    with pytest.raises(BodyError) as err:
        decode_body(body, ChatRequest)
    assert err.value.param == param
    assert words in str(err.value)
    if param:
        assert str(err.value).startswith(param + ": ")


@pytest.mark.parametrize("body, words", [(b"{bad", "not valid JSON"), (b"", "empty"), (b"  ", "empty")])
def test_malformed_json_says_so(body, words):
    with pytest.raises(BodyError, match=words):
        decode_body(body, ChatRequest)


def test_unknown_fields_are_refused_naming_them():
    """Nothing silently ignored, on /v1 as on /admin/guard; the field is the param."""
    assert chat(parallel_tool_calls=False, metadata={"a": "1"}, user="u").model == "m"
    for body, param in ((b'{"model": "m", "messages": [], "typical_p": 0.5}', "typical_p"),
                        (b'{"model": "m", "messages": [{"role": "user", "content": "x", "colour": 1}]}',
                         "messages[0].colour")):
        with pytest.raises(BodyError) as err:
            decode_body(body, ChatRequest)
        assert err.value.param == param and "unknown field" in str(err.value)
    with pytest.raises(BodyError) as err:
        decode_body(b'{"teir": "safe"}', GuardSettingsIn)
    assert err.value.param == "teir"


def test_chat_becomes_generate_with_messages_for_the_chat_template():
    gen = chat(messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               max_completion_tokens=7, temperature=0, stop="END", seed=3)
    gen = chat_generate(gen).gen
    assert [(m.role, m.content) for m in gen.messages] == [("system", "be brief"), ("user", "ab")]
    assert gen.prompt is None and gen.max_tokens == 7 and gen.temperature == 0.0
    assert gen.stop == ["END"] and gen.seed == 3
    assert gen.request_id == ""  # the supervisor gives each request its id, in one place


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64])
def test_a_seed_the_wire_cannot_carry_is_a_400_naming_seed(seed):
    """Past int64/uint64 the supervisor could not encode the worker's command: a 500."""
    with pytest.raises(BodyError) as err:
        chat_generate(chat(seed=seed))
    assert err.value.param == "seed"
    assert chat_generate(chat(seed=-1)).gen.seed == -1
    assert chat_generate(chat(seed=2**64 - 1)).gen.seed == 2**64 - 1
    assert msgspec.msgpack.encode(chat_generate(chat(seed=-(2**63))).gen)  # the supervisor can send it


def test_defaults_bound_the_generation():
    assert chat_generate(chat()).gen.max_tokens == DEFAULT_CHAT_MAX_TOKENS
    req = decode_body(b'{"model": "m", "prompt": "once"}', CompletionRequest)
    gen = completion_generates(req)[0].gen
    assert gen.prompt == "once" and gen.messages is None and gen.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 2}, "n"),
        ({"logprobs": 3}, "logprobs"),  # chat's is true/false
        ({"top_logprobs": 2}, "top_logprobs"),  # ... and top_logprobs needs it
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"logit_bias": {"42": 500}}, "logit_bias[...]"),  # honoured within -100..100
        ({"store": True}, "store"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"presence_penalty": 2.5}, "presence_penalty"),  # ... within -2..2
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        # an image part needs its image (docs/vision.md; images themselves: tests/test_api_images.py)
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].image_url.url"),
    ],
)
def test_known_parameters_we_cannot_honour_are_refused_not_ignored(fields, param):
    with pytest.raises(BodyError) as err:
        chat_generate(chat(**fields))
    assert err.value.param == param


def _generate(api: str, body: dict) -> p.Generate:
    from supervisor.http.anthropic import MessagesRequest, messages_generate
    from supervisor.http.responses import ResponsesRequest, responses_generate

    raw = msgspec.json.encode({"model": "m", **body})
    if api == "chat":
        return chat_generate(decode_body(raw, ChatRequest)).gen
    if api == "anthropic":
        return messages_generate(decode_body(raw, MessagesRequest)).gen
    return responses_generate(decode_body(raw, ResponsesRequest)).gen


_TEXT = {"type": "text", "text": "a"}


@pytest.mark.parametrize(
    "api, body, param",
    [
        ("chat", {"messages": [{"role": "user", "content": [_TEXT, {"type": "text"}]}]}, "messages[0].content[1].text"),
        ("anthropic", {"max_tokens": 5, "messages": [{"role": "user", "content": [_TEXT, {"type": "image"}]}]},
         "messages[0].content[1].source"),  # an image block needs its source (docs/vision.md)
        ("anthropic", {"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a", "citations": [{"type": "x"}]}]}]}, "messages[0].content[0].citations"),
        ("anthropic", {"max_tokens": 5, "system": [_TEXT, {"type": "document"}], "messages": [
            {"role": "user", "content": "hi"}]}, "system[1].type"),
        ("anthropic", {"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
         "messages[0].content[0].content[0].type"),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_image"}]}]}, "input[0].content[1].image_url"),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]},
         "input[0].output[0].type"),
    ],
)
def test_content_that_is_not_text_is_refused_at_its_own_path(api, body, param):
    """One reader (supervisor/http/content.py) for all three APIs: a part that is not text,
    or a text part with no text, is a 400 naming that part, never dropped."""
    with pytest.raises(BodyError) as err:
        _generate(api, body)
    assert err.value.param == param and str(err.value).startswith(param.rsplit(".", 1)[0])


@pytest.mark.parametrize("api, body", [
    ("chat", {"messages": [{"role": "user", "content": [_TEXT, {"type": "input_text", "text": "b"}]}]}),
    ("anthropic", {"max_tokens": 5, "messages": [{"role": "user", "content": [_TEXT, {"type": "text", "text": "b"}]}]}),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "output_text", "text": "b"}]}]}),
])
def test_text_parts_are_joined_in_every_api(api, body):
    assert [(m.role, m.content) for m in _generate(api, body).messages] == [("user", "ab")]


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", ""]}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"), ({"prompt": [1, "x"]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[1], [True]]}, "prompt"), ({"prompt": {"a": 1}}, "prompt"), ({"prompt": ["a"] * 257}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"), ({"echo": True, "suffix": "y"}, "echo"),
    ({"prompt": ["a", "b"], "suffix": "y"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"stop": [str(i) for i in range(17)]}, "stop")])
def test_completion_refusals_name_the_parameter(fields, param):
    body = {"model": "m", "prompt": "x", **fields}
    with pytest.raises(BodyError) as err:
        completion_generates(decode_body(msgspec.json.encode(body), CompletionRequest))
    assert err.value.param == param


def test_completion_prompts_are_strings_token_ids_or_lists_of_either():
    """lm-evaluation-harness sends token ids, several prompts per request (`[[17872, 42, ...], ...]`),
    echo with max_tokens 0 or 1, and its task's stop strings plus the EOS text: each prompt is a
    Generate of its own; "Expected `str`, got `array`", "exactly one prompt per request" and
    "echo: not supported" were 400s."""

    def gens(**fields):
        body = {"model": "m", "prompt": "x", **fields}
        return [w.gen for w in completion_generates(decode_body(msgspec.json.encode(body), CompletionRequest))]

    assert [(g.prompt, g.prompt_tokens) for g in gens(prompt="hi")] == [("hi", None)]
    assert [(g.prompt, g.prompt_tokens) for g in gens(prompt=[1, 2, 3])] == [(None, [1, 2, 3])]
    assert [(g.prompt, g.prompt_tokens) for g in gens(prompt=[[1, 2], "b", [3]])] == [
        (None, [1, 2]), ("b", None), (None, [3])]
    [echo] = gens(prompt=[[5, 6]], echo=True, logprobs=1, max_tokens=0, temperature=0, seed=1234)
    assert (echo.echo, echo.max_tokens, echo.logprobs, echo.top_logprobs) == (True, 0, True, 1)
    assert len(gens(prompt=["a"] * 256)) == 256
    assert gens(stop=[str(i) for i in range(16)])[0].stop == [str(i) for i in range(16)]


def test_g1_prefill_rejection_is_a_400_with_the_figures():
    """SPEC G1: a prompt that does not fit is the client's to shorten (400), not a crash (500)."""
    err = from_failed(p.Failed(request_id="r", code="prefill_memory_exceeded", message="needs 9 GiB, limit 8 GiB",
                               estimated_bytes=9, limit_bytes=8, binding="dynamic"))
    body = msgspec.json.decode(err.body())
    assert err.status == 400
    assert body["error"] == {"message": "needs 9 GiB, limit 8 GiB", "type": "invalid_request_error",
                             "param": None, "code": "prefill_memory_exceeded", "binding": "dynamic",
                             "estimated_bytes": 9, "limit_bytes": 8}


@pytest.mark.parametrize("code, status", [("memory_pressure", 503), ("model_unloading", 503),
                                          ("worker_exited", 503), ("invalid_request", 400), ("weird", 500)])
def test_worker_failures_map_to_who_should_act(code, status):
    err = from_failed(p.Failed(request_id="r", code=code, message="m"))
    assert err.status == status
    assert ("Retry-After" in err.headers) == (status == 503)
    assert "binding" not in msgspec.json.decode(err.body())["error"]


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("192.0.2.2", False),
                                            ("::ffff:192.0.2.2", False), ("localhost", False), ("", False),
                                            (None, False)])
def test_loopback_detection_for_admin_endpoints(host, loopback):
    assert is_loopback_client(host) is loopback


def test_metric_labels_stay_bounded():
    assert endpoint_label("/v1/models/org/model-7b/load") == "/v1/models/{id}/load"
    assert endpoint_label("/v1/models/anything") == "/v1/models/{id}"
    assert endpoint_label("/wp-admin.php") == "other"
    assert endpoint_label("/v1/chat/completions") == "/v1/chat/completions"


def test_a_tool_call_list_cut_by_max_tokens_keeps_its_whole_calls():
    """The calls completed before the cut come back; a cut one is dropped."""
    from supervisor.http.tools import parse_constrained

    cut = '[{"name":"f","arguments":{"s":"a\\"}]"}},{"name":"f","arguments":{"s":"'
    [call] = parse_constrained(cut)
    assert call.name == "f" and msgspec.json.decode(call.arguments) == {"s": 'a"}]'}
    assert parse_constrained('[{"name":"f","argu') is None
    assert len(parse_constrained('[{"name":"f","arguments":{}},{"name":"g","arguments":{"x":1}}]')) == 2


def test_tagged_tool_calls_are_read_only_when_the_reply_opens_with_one():
    from supervisor.http.tools import opens_with_call, parse_tagged

    text, calls = parse_tagged(' <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n')
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a":1}')]
    assert parse_tagged('Sure. <tool_call>{"name": "f"}</tool_call>') == ('Sure. <tool_call>{"name": "f"}</tool_call>', [])
    assert opens_with_call("<tool") is None and opens_with_call("<b>") is False


def test_the_stop_matcher_remembers_which_stop_ended_the_text():
    from worker.stops import StopMatcher

    m = StopMatcher(["END", "STOP"])
    assert m.feed("abc ST") == ("abc ", False) and m.hit == ""
    assert m.feed("OP and END") == ("", True) and m.hit == "STOP"
