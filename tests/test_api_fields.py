"""Nothing silently ignored, and refusals in each API's own shape.

The field walk: every field of the openai SDK's chat and completions request
types and of the anthropic SDK's MessageCreateParams is classified here as
honoured, accepted with no effect (only where that is truthful, see the
request Structs' comments) or refused, and each refused one, sent with a
value that is not neutral, is a 400 naming it. A field a future SDK adds
fails the walk until someone decides what it means here.

Then the refusals through the real SDKs against the real app (a stub
supervisor behind it, no worker): the guard's 507, the 503 with
Retry-After and the 400 prefill_memory_exceeded reach anthropic and the
Responses API as the exceptions their SDKs raise, message intact; API keys
are 401s in each API's shape, /health stays open, and no key is logged.
"""

from __future__ import annotations

import asyncio
import logging

import anthropic
import msgspec
import openai
import pytest
from anthropic.types.message_create_params import MessageCreateParamsBase
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams
from openai.types.responses.response_create_params import ResponseCreateParamsBase as ResponseParams

from shared import protocol as p
from supervisor.config import ModelConfig
from supervisor.doors.refusals import GateClosed, LoadError
from supervisor.http.anthropic import MessagesRequest, messages_generate
from supervisor.http.completions import completion_generates
from supervisor.http.keepalive import keep_alive_seconds
from supervisor.http.openai import chat_generate
from supervisor.http.openai_types import BodyError, ChatRequest, CompletionRequest, decode_body
from supervisor.http.responses import ResponsesRequest, responses_generate
from tests.frontdoor_harness import MSG, StubSupervisor, serving


def _fields(typed_dict) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


# Honoured: changes what is generated. Accepted: no effect on the output, truthfully.
CHAT_HONOURED = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
                 "stream_options", "tools", "tool_choice", "parallel_tool_calls", "response_format", "n",
                 "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "modalities", "logit_bias"}
CHAT_ACCEPTED = {"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                 "prompt_cache_options", "service_tier", "prediction", "store"}
# Refused unless neutral: a non-neutral value each.
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "moderation": {"type": "auto"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "n": 2, "store": True, "modalities": ["text", "audio"],
    "tool_choice": {"type": "allowed_tools", "allowed_tools": {}},
}
COMPLETION_HONOURED = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream_options",
                       "n", "best_of", "echo", "suffix", "logprobs", "presence_penalty", "frequency_penalty",
                       "logit_bias"}
COMPLETION_ACCEPTED = {"user"}
COMPLETION_REFUSED = {"best_of": 2, "n": 3}
ANTHROPIC_HONOURED = {"model", "max_tokens", "messages", "system", "stop_sequences", "tools", "tool_choice"}
ANTHROPIC_ACCEPTED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id",
                      "workspace_id"}
ANTHROPIC_REFUSED = {"thinking": {"type": "enabled", "budget_tokens": 1024},
                     "output_config": {"effort": "high"}, "container": "c1",
                     "diagnostics": {"x": 1}}
RESPONSES_HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                      "tool_choice", "parallel_tool_calls", "text", "store", "truncation", "include",
                      "top_logprobs"}
RESPONSES_ACCEPTED = {"metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                      "prompt_cache_options", "service_tier", "stream_options"}
RESPONSES_REFUSED = {"previous_response_id": "resp_1", "conversation": "c", "background": True,
                     "background_options": {}, "reasoning": {"effort": "low"}, "prompt": {"id": "p"},
                     "max_tool_calls": 2, "context_management": [{}], "moderation": {},
                     "access_programs": {}, "image": {}, "store": True, "truncation": "auto",
                     "include": ["reasoning.encrypted_content"]}


def _chat(**kw):
    return chat_generate(decode_body(msgspec.json.encode({"model": "m", "messages": MSG, **kw}), ChatRequest)).gen


def _completion(**kw):
    return completion_generates(decode_body(msgspec.json.encode({"model": "m", "prompt": "x", **kw}),
                                            CompletionRequest))[0].gen


def _anthropic(**kw):
    body = {"model": "m", "max_tokens": 4, "messages": MSG, **kw}
    return messages_generate(decode_body(msgspec.json.encode(body), MessagesRequest)).gen


def _responses(**kw):
    return responses_generate(decode_body(msgspec.json.encode({"model": "m", "input": "x", **kw}),
                                          ResponsesRequest)).gen


WALKS = [
    ("chat", ChatParams, ChatRequest, _chat, CHAT_HONOURED, CHAT_ACCEPTED, CHAT_REFUSED),
    ("completions", CompletionParams, CompletionRequest, _completion, COMPLETION_HONOURED, COMPLETION_ACCEPTED,
     COMPLETION_REFUSED),
    ("anthropic", MessageCreateParamsBase, MessagesRequest, _anthropic, ANTHROPIC_HONOURED, ANTHROPIC_ACCEPTED,
     ANTHROPIC_REFUSED),
    ("responses", ResponseParams, ResponsesRequest, _responses, RESPONSES_HONOURED, RESPONSES_ACCEPTED,
     RESPONSES_REFUSED),
]


@pytest.mark.parametrize("walk", WALKS, ids=[w[0] for w in WALKS])
def test_every_sdk_request_field_is_honoured_accepted_or_refused_by_name(walk):
    _, sdk, struct, send, honoured, accepted, refused = walk
    sdk_fields = _fields(sdk)
    declared = set(struct.__struct_fields__)
    unclassified = sdk_fields - honoured - accepted - set(refused)
    assert not unclassified, f"SDK fields nobody decided about: {sorted(unclassified)}"
    assert sdk_fields <= declared, f"SDK fields the request Struct lacks: {sorted(sdk_fields - declared)}"
    for name, value in refused.items():
        with pytest.raises(BodyError) as err:
            send(**{name: value})
        assert err.value.param is not None and err.value.param.split(".")[0] == name, (name, err.value)


def test_accepted_fields_decode_with_ordinary_values():
    _chat(user="u", metadata={"k": "v"}, safety_identifier="s", prompt_cache_key="k", store=False,
          service_tier="auto", prediction={"type": "content", "content": "x"}, prompt_cache_retention="24h")
    _anthropic(metadata={"user_id": "u"}, service_tier="auto", inference_geo="us", speed="fast",
               thinking={"type": "disabled"}, temperature=0.5)
    _responses(metadata={"k": "v"}, store=False, truncation="disabled", include=[], user="u")


@pytest.mark.parametrize("send", [_chat, _completion, _anthropic, _responses])
def test_an_unknown_field_is_a_400_naming_it_on_every_api(send):
    with pytest.raises(BodyError) as err:
        send(top_k_typo=3)
    assert err.value.param == "top_k_typo" and "unknown field" in str(err.value)


# -- the sampling options -------------------------------------------------------

EXTRAS = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "repetition_context_size": 32,
          "presence_penalty": 0.5, "presence_context_size": 8, "frequency_penalty": -0.5,
          "frequency_context_size": 12}


@pytest.mark.parametrize("send", [_chat, _completion, _responses], ids=["chat", "completions", "responses"])
def test_sampling_fields_and_extra_body_fields_reach_the_worker(send):
    gen = send(**EXTRAS, logit_bias={"42": 10, "7": -100})
    assert {name: getattr(gen, name) for name in EXTRAS} == EXTRAS
    assert gen.logit_bias == {42: 10.0, 7: -100.0}
    plain = send()
    assert (plain.top_k, plain.min_p, plain.repetition_penalty, plain.presence_penalty, plain.frequency_penalty,
            plain.logit_bias, plain.logprobs) == (0, 0.0, 1.0, 0.0, 0.0, {}, False)


def test_anthropic_top_k_reaches_the_worker():
    assert _anthropic(top_k=3).top_k == 3
    assert _anthropic().top_k == 0


@pytest.mark.parametrize("send, field, value", [
    (_chat, "top_k", -1), (_chat, "min_p", 1.5), (_chat, "repetition_penalty", 0), (_chat, "presence_penalty", 2.5),
    (_chat, "frequency_penalty", -3), (_chat, "repetition_context_size", -1), (_chat, "logit_bias", {"1": 101}),
    (_chat, "logit_bias", {"x": 1}), (_chat, "logit_bias", {"-3": 1}), (_chat, "top_logprobs", 21),
    (_chat, "logprobs", 3), (_completion, "logprobs", 21), (_completion, "logprobs", True),
    (_completion, "min_p", -0.1), (_responses, "top_logprobs", -1), (_responses, "top_k", "many"),
    (_anthropic, "top_k", -2)])
def test_a_sampling_value_out_of_bounds_is_a_400_naming_it(send, field, value):
    with pytest.raises(BodyError) as err:
        send(**{field: value})
    assert err.value.param is not None and err.value.param.split("[")[0] == field, err.value


def test_chat_top_logprobs_needs_logprobs_true_as_on_openai():
    with pytest.raises(BodyError) as err:
        _chat(top_logprobs=2)
    assert err.value.param == "top_logprobs"
    assert (_chat(logprobs=True, top_logprobs=2).logprobs, _chat(logprobs=True, top_logprobs=2).top_logprobs) == (True, 2)
    assert not _chat(logprobs=False).logprobs


def test_logprobs_spelled_each_apis_way_ask_the_worker_for_them():
    assert (_completion(logprobs=3).logprobs, _completion(logprobs=3).top_logprobs) == (True, 3)
    assert (_completion(logprobs=0).logprobs, _completion(logprobs=0).top_logprobs) == (True, 0)
    included = _responses(include=["message.output_text.logprobs"])
    assert (included.logprobs, included.top_logprobs) == (True, 0)
    assert (_responses(top_logprobs=4).logprobs, _responses(top_logprobs=4).top_logprobs) == (True, 4)
    assert not _responses().logprobs


def test_response_format_and_tool_choice_become_worker_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    gen = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                         "strict": True}})
    assert isinstance(gen.constraint, p.JsonSchema) and gen.constraint.strict
    assert isinstance(_chat(response_format={"type": "json_object"}).constraint, p.JsonObject)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    named = _chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert isinstance(named.constraint, p.ToolCallConstraint) and named.constraint.mode == "named" and named.tools
    assert _chat(tools=tools).constraint is None and _chat(tools=tools, tool_choice="none").constraint is None
    with pytest.raises(BodyError) as err:
        _chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}})
    assert err.value.param == "tool_choice"
    any_ = _anthropic(tools=[{"name": "f", "input_schema": schema}], tool_choice={"type": "any"})
    assert any_.constraint.mode == "required" and not any_.constraint.parallel  # one call unless asked


@pytest.mark.parametrize("given, seconds", [({"keep_alive": "5m"}, 300.0), ({"keep_alive": "1h30m"}, 5400.0),
                                            ({"keep_alive": -1}, 0.0), ({"keep_alive": "0"}, 1e-3),
                                            ({"ttl": 60}, 60.0), ({}, None)])
def test_keep_alive_and_ttl_become_an_idle_timer(given, seconds):
    assert keep_alive_seconds(given.get("keep_alive"), given.get("ttl")) == seconds


def test_a_bad_keep_alive_is_a_400_naming_it():
    with pytest.raises(BodyError) as err:
        keep_alive_seconds("soon", None)
    assert err.value.param == "keep_alive"


# ---------------------------------------------------------------------------
# the real app, a stub supervisor: refusals and keys through the SDKs


NO_FIT = LoadError("model m needs 9.0 GiB but the ceiling leaves 2.0 GiB (binding: dynamic)",
                   code="model_too_large", http_status=507)
QUEUE_FULL = GateClosed("the queue is full while memory pressure pauses admission; retry later", retry_after=7)


def prefill_refused(rid):
    return [p.Failed(request_id=rid, code="prefill_memory_exceeded", message="the prompt's prefill needs 3 GiB",
                     binding="static", estimated_bytes=3 << 30, limit_bytes=1 << 30)]


def hello(rid):
    return [p.TokenOut(request_id=rid, text="Hello"),
            p.Finished(request_id=rid, finish_reason="stop", prompt_tokens=3, completion_tokens=1)]


@pytest.mark.parametrize("outcome, status, exc_oa, exc_an", [
    (NO_FIT, 507, openai.InternalServerError, anthropic.InternalServerError),
    (QUEUE_FULL, 503, openai.InternalServerError, anthropic.InternalServerError),
    (prefill_refused, 400, openai.BadRequestError, anthropic.BadRequestError),
], ids=["507-does-not-fit", "503-queue-full", "400-prefill"])
def test_memory_refusals_reach_anthropic_and_responses_clients_with_the_message(outcome, status, exc_oa, exc_an):
    async def main():
        async with serving(StubSupervisor(outcome)) as (_, oa, an):
            with pytest.raises(exc_an) as a_err:
                await an.messages.create(model="m", max_tokens=4, messages=MSG)
            with pytest.raises(exc_an) as a_stream_err:
                async with an.messages.stream(model="m", max_tokens=4, messages=MSG) as s:
                    await s.get_final_message()
            with pytest.raises(exc_oa) as r_err:
                await oa.responses.create(model="m", input="x")
            with pytest.raises(exc_oa) as r_stream_err:
                await oa.responses.create(model="m", input="x", stream=True)
            return a_err.value, a_stream_err.value, r_err.value, r_stream_err.value

    a, a_stream, r, r_stream = asyncio.run(main())
    words = {507: "needs 9.0 GiB", 503: "queue is full", 400: "prefill needs 3 GiB"}[status]
    for e in (a, a_stream):
        assert e.status_code == status and words in e.message and e.body["type"] == "error"
        assert e.body["error"]["message"].startswith(str(words).split()[0]) or words in e.body["error"]["message"]
    for e in (r, r_stream):
        assert e.status_code == status and words in e.message
    if status == 503:
        assert all(e.response.headers["retry-after"] == "7" for e in (a, r))
    if status == 400:
        assert a.body["error"]["code"] == "prefill_memory_exceeded" and a.body["error"]["binding"] == "static"
        assert r.code == "prefill_memory_exceeded"


def test_api_keys_401_in_each_apis_shape_health_open_and_keys_never_logged(caplog):
    caplog.set_level(logging.DEBUG)
    sup = StubSupervisor(hello, api_keys=["k1"], admin_token="admin-secret")

    async def main():
        async with serving(sup) as (http, oa, an):
            good_oa = await oa.chat.completions.create(model="m", messages=MSG)
            good_an = await an.messages.create(model="m", max_tokens=4, messages=MSG)  # x-api-key
            bad_oa = oa.with_options(api_key="wrong")
            bad_an = an.with_options(api_key="wrong")
            errors = []
            for call in (lambda: bad_oa.chat.completions.create(model="m", messages=MSG),
                         lambda: bad_oa.responses.create(model="m", input="x"),
                         lambda: bad_an.messages.create(model="m", max_tokens=4, messages=MSG)):
                with pytest.raises((openai.AuthenticationError, anthropic.AuthenticationError)) as err:
                    await call()
                errors.append(err.value)
            missing = await http.post("/v1/chat/completions", json={"model": "m", "messages": MSG})
            models = await http.get("/v1/models")
            admin = await http.post("/v1/chat/completions", json={"model": "m", "messages": MSG},
                                    headers={"authorization": "Bearer admin-secret"})
            health = await http.get("/health")
            events = [(await http.get("/v1/events" + q)).status_code for q in ("", "?api_key=wrong")]
            return good_oa, good_an, errors, missing, models, admin, health, events

    good_oa, good_an, errors, missing, models, admin, health, events = asyncio.run(main())
    assert events == [401, 401]  # /v1/events too (a key may come as ?api_key=: EventSource sends no headers)
    assert good_oa.choices[0].message.content == "Hello" and good_an.content[0].text == "Hello"
    assert [e.status_code for e in errors] == [401, 401, 401]
    assert errors[0].body["type"] == "authentication_error" and errors[0].code == "invalid_api_key"
    assert errors[2].body == {"type": "error", "error": {"type": "authentication_error", "code": "invalid_api_key",
                                                         "message": "the API key is not valid for this server"}}
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    assert models.status_code == 401 and admin.status_code == 200 and health.status_code == 200
    # the server's own logs (the test's HTTP client logs its URLs, ?api_key= included)
    logged = " ".join(r.getMessage() for r in caplog.records if r.name.startswith(("memvisor", "uvicorn")))
    assert "Shutting down" in logged
    assert "k1" not in logged and "wrong" not in logged


def test_per_request_keep_alive_reaches_the_supervisor():
    sup = StubSupervisor(hello)

    async def main():
        async with serving(sup) as (_, oa, an):
            await oa.chat.completions.create(model="m", messages=MSG, extra_body={"keep_alive": "10m"})
            await an.messages.create(model="m", max_tokens=4, messages=MSG, extra_body={"ttl": 30})
            await oa.responses.create(model="m", input="x", extra_body={"keep_alive": 0})

    asyncio.run(main())
    assert sup.kept == [600.0, 30.0, 1e-3]


def test_a3_507_from_real_admission_reaches_the_anthropic_and_responses_sdks(tmp_path):
    """SPEC A3 on a real supervisor (no worker is spawned: the model is refused from its
    safetensors header): each SDK raises for the 507 and the message names what binds."""
    from shared.sizes import GiB
    from tests.frontdoor_harness import fake_huge_model
    from tests.http_harness import LiveServer, make_config

    models = [ModelConfig(id="huge", path=str(fake_huge_model(tmp_path / "huge", 1024 * GiB)))]
    with LiveServer(make_config(models, api_keys=["k1"]), tmp_path / "rt") as live:
        async def main():
            an = live.anthropic(api_key="k1")
            oa = live.openai(api_key="k1")
            with pytest.raises(anthropic.InternalServerError) as a_err:
                await an.messages.create(model="huge", max_tokens=4, messages=MSG)
            with pytest.raises(openai.InternalServerError) as r_err:
                await oa.responses.create(model="huge", input="x", stream=True)
            return a_err.value, r_err.value

        a, r = live.run(main())
    assert a.status_code == r.status_code == 507
    assert a.body["error"]["code"] == "model_too_large" and a.body["error"]["message"] in a.message
    assert "needs 1 TiB" in a.message and "ceiling" in a.message  # what binds, intact
    assert r.code == "model_too_large" and "needs 1 TiB" in r.message and "ceiling" in r.message


def tagged_call(rid):
    pieces = [" <tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "</tool_call>"]
    return [p.TokenOut(request_id=rid, text=t) for t in pieces] + [
        p.Finished(request_id=rid, finish_reason="stop", prompt_tokens=9, completion_tokens=5)]


def test_auto_tool_choice_reads_a_reply_that_opens_with_a_tagged_call_streamed_and_not():
    """The held-back text becomes delta.tool_calls / message.tool_calls; a plain reply is content."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    async def main():
        async with serving(StubSupervisor(tagged_call)) as (_, oa, an):
            whole = await oa.chat.completions.create(model="m", messages=MSG, tools=tools)
            chunks = [c async for c in await oa.chat.completions.create(model="m", messages=MSG, tools=tools,
                                                                        stream=True)]
            anth = await an.messages.create(model="m", max_tokens=9, messages=MSG,
                                            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])
        async with serving(StubSupervisor(hello)) as (_, oa, _an):
            plain = [c async for c in await oa.chat.completions.create(model="m", messages=MSG, tools=tools,
                                                                       stream=True)]
        return whole, chunks, anth, plain

    whole, chunks, anth, plain = asyncio.run(main())
    [call] = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Oslo"}')
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert not any(c.choices[0].delta.content for c in chunks) and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert anth.stop_reason == "tool_use" and anth.content[0].input == {"city": "Oslo"}
    assert "".join(c.choices[0].delta.content or "" for c in plain) == "Hello"
    assert plain[-1].choices[0].finish_reason == "stop"


def aborted_mid_stream(rid):
    return [p.TokenOut(request_id=rid, text="Hel"),
            p.Failed(request_id=rid, code="memory_pressure", message="aborted: memory pressure (P6.3)")]


def test_a_failure_after_the_first_token_is_an_error_event_each_sdk_sees():
    async def main():
        async with serving(StubSupervisor(aborted_mid_stream)) as (_, oa, an):
            with pytest.raises(anthropic.APIStatusError) as a_err:
                async with an.messages.stream(model="m", max_tokens=4, messages=MSG) as s:
                    await s.get_final_message()
            events = [e async for e in await oa.responses.create(model="m", input="x", stream=True)]
        return a_err.value, events

    a, events = asyncio.run(main())
    assert "memory pressure" in str(a) and a.body["error"]["type"] == "overloaded_error"
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "memory_pressure" and events[-1].response.error.code == "memory_pressure"


def test_api_keys_config_refuses_empty_keys_and_a_missing_file_and_reads_one_key_a_line(tmp_path):
    from supervisor.config_file import ConfigError, load_config
    from supervisor.http.auth import ApiKeys

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nk-file-1\n\n  k-file-2  \n")
    for body, words in (('api_keys = [""]', "api_keys"), (f'api_keys_file = "{tmp_path}/none"', "api_keys_file")):
        path = tmp_path / "bad.toml"
        path.write_text("[supervisor]\n" + body + "\n")
        with pytest.raises(ConfigError, match=words):
            load_config(path)
    good = tmp_path / "good.toml"
    good.write_text(f'[supervisor]\napi_keys = ["k-inline"]\napi_keys_file = "{keys}"\n')
    api = ApiKeys.from_config(load_config(good).supervisor)
    assert api.valid("k-inline") and api.valid("k-file-1") and api.valid("k-file-2") and not api.valid("k-file")
    assert not ApiKeys([]).enabled


# -- logprobs in each API's shape, read back by the SDKs -----------------------

def _lp(token: str, logprob: float) -> p.TokenLogprobs:
    return p.TokenLogprobs(token=token, logprob=logprob,
                           top=[p.TopLogprob(token=token, logprob=logprob), p.TopLogprob(token="é", logprob=logprob - 2)])


def with_logprobs(rid):
    """Three tokens; the second's text is held back by the detokenizer (it comes with the third)."""
    return [p.TokenOut(request_id=rid, text="Hel", token_id=1, logprobs=_lp("Hel", -0.5)),
            p.TokenOut(request_id=rid, text="", token_id=2, logprobs=_lp("l", -1.5)),
            p.TokenOut(request_id=rid, text="lo", token_id=3, logprobs=_lp("o", -0.25)),
            p.Finished(request_id=rid, finish_reason="length", prompt_tokens=3, completion_tokens=3)]


WANT = [("Hel", -0.5), ("l", -1.5), ("o", -0.25)]


def test_logprobs_come_back_in_openais_shapes_whole_and_streamed():
    async def main():
        async with serving(StubSupervisor(with_logprobs)) as (_, oa, _an):
            chat = await oa.chat.completions.create(model="m", messages=MSG, logprobs=True, top_logprobs=2)
            chat_chunks = [c async for c in await oa.chat.completions.create(
                model="m", messages=MSG, logprobs=True, top_logprobs=2, stream=True)]
            text = await oa.completions.create(model="m", prompt="x", logprobs=2)
            text_chunks = [c async for c in await oa.completions.create(model="m", prompt="x", logprobs=2, stream=True)]
            resp = await oa.responses.create(model="m", input="x", include=["message.output_text.logprobs"],
                                             top_logprobs=2)
            events = [e async for e in await oa.responses.create(model="m", input="x", top_logprobs=2, stream=True)]
            plain = await oa.chat.completions.create(model="m", messages=MSG)
        return chat, chat_chunks, text, text_chunks, resp, events, plain

    chat, chat_chunks, text, text_chunks, resp, events, plain = asyncio.run(main())
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == WANT
    assert content[0].bytes == list(b"Hel") and [t.token for t in content[0].top_logprobs] == ["Hel", "é"]
    assert content[0].top_logprobs[1].bytes == list("é".encode())
    streamed = [c for chunk in chat_chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == WANT
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == "Hello"
    lp = text.choices[0].logprobs
    assert lp.tokens == ["Hel", "l", "o"] and lp.token_logprobs == [-0.5, -1.5, -0.25]
    assert lp.text_offset == [0, 3, 4] and lp.top_logprobs[2] == {"o": -0.25, "é": -2.25}
    streamed_text = [t for c in text_chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in text_chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed_text == ["Hel", "l", "o"] and offsets == [0, 3, 4]
    part = resp.output[0].content[0]
    assert [(x.token, x.logprob) for x in part.logprobs] == WANT and len(part.logprobs[0].top_logprobs) == 2
    deltas = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    assert [(x.token, x.logprob) for x in deltas] == WANT
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(x.token, x.logprob) for x in done.logprobs] == WANT
    assert plain.choices[0].logprobs is None  # asked for nothing: nothing reported


def test_a_token_batch_carries_logprobs_only_for_the_rows_that_asked():
    lp = _lp("a", -0.1)
    batch = p.coalesce([p.TokenOut(request_id="r1", text="a", token_id=1, logprobs=lp),
                        p.TokenOut(request_id="r2", text="b", token_id=2)])[0]
    codec = p.Codec(p.WorkerReply)
    back = codec.decode(codec.encode(batch))
    assert isinstance(back, p.TokenBatch) and back.logprobs == [lp, None]
    r1, r2 = back.tokens()
    assert r1.logprobs == lp and r2.logprobs is msgspec.UNSET
    plain = p.coalesce([p.TokenOut(request_id="r1", text="a", token_id=1), p.TokenOut(request_id="r2", text="b")])[0]
    assert b"logprobs" not in codec.encode(plain)  # no column, not one byte, when nobody asked
    assert b"logprobs" not in codec.encode(p.TokenOut(request_id="r", text="a"))
    torn = p.TokenBatch(request_ids=["r1", "r2"], texts=["a", "b"], token_ids=[1, 2], logprobs=[lp])
    assert not torn.well_formed() and torn.tokens() == []
