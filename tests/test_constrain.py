"""Constrained decoding on the engine, with a random-weight model (real MLX, CPU).

A model with random weights is the hardest client a grammar can have: it
never wants to close a string. Validity here comes from the mask and the
budget wrap-up alone.
"""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from shared import protocol as p
from shared.protocol import Failed, Finished, Generate, TokenOut
from tests.constrain_harness import ADD, PERSON, TOOLS, WEATHER, end_of, json_prompts, run_wide, text_of
from tests.engine_harness import engine_for
from worker.constrain import ConstraintError, ConstraintFactory, closed_properties, tool_call_schema


def test_named_tool_call_arguments_validate(loaded):
    engine = engine_for(loaded)
    spec = p.ToolCallConstraint(functions=TOOLS, mode="named", name="add")
    for i, prompt in enumerate(json_prompts(engine, 5)):
        engine.submit(f"t{i}", prompt, max_tokens=96, temperature=1.0, seed=i, constraint=spec)
    runs = run_wide(engine)
    for i in range(5):
        calls = json.loads(text_of(runs[f"t{i}"]))
        assert [call["name"] for call in calls] == ["add"]
        jsonschema.validate(calls[0]["arguments"], ADD)


def test_required_tool_call_is_one_of_the_functions_with_valid_arguments(loaded):
    engine = engine_for(loaded)
    spec = p.ToolCallConstraint(functions=TOOLS, mode="required")
    for i, prompt in enumerate(json_prompts(engine, 6)):
        engine.submit(f"t{i}", prompt, max_tokens=96, temperature=1.0, seed=i, constraint=spec)
    runs = run_wide(engine)
    schemas = {"get_weather": WEATHER, "add": ADD}
    for i in range(6):
        (call,) = json.loads(text_of(runs[f"t{i}"]))
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_json_object_yields_a_json_object(loaded):
    engine = engine_for(loaded)
    for i, prompt in enumerate(json_prompts(engine, 6)):
        engine.submit(f"o{i}", prompt, max_tokens=64, temperature=1.0 if i % 2 else 0.0, seed=i,
                      constraint=p.JsonObject())
    runs = run_wide(engine)
    for i in range(6):
        assert isinstance(json.loads(text_of(runs[f"o{i}"])), dict)


def test_an_output_the_budget_closes_is_complete_and_finishes_with_length(loaded):
    engine = engine_for(loaded)
    spec = p.JsonSchema(schema=json.dumps(PERSON))
    engine.submit("w", json_prompts(engine, 1)[0], max_tokens=80, constraint=spec)  # greedy never closes alone
    events = run_wide(engine)["w"]
    jsonschema.validate(json.loads(text_of(events)), PERSON)
    assert end_of(events).finish_reason == "length" and end_of(events).completion_tokens <= 80


def test_a_complete_grammar_finishes_with_stop_before_max_tokens(loaded):
    engine = engine_for(loaded)
    spec = p.JsonSchema(schema=json.dumps({"enum": ["red", "green", "blue"]}))
    engine.submit("e", json_prompts(engine, 1)[0], max_tokens=50, constraint=spec)
    events = run_wide(engine)["e"]
    end = end_of(events)
    assert json.loads(text_of(events)) in ("red", "green", "blue")
    assert end.finish_reason == "stop" and end.completion_tokens < 50


@pytest.mark.parametrize("spec, named", [
    (p.JsonSchema(schema='{"type": "object", "properties": {"a": {"type": "strnig"}}}'), "strnig"),
    (p.JsonSchema(schema='{"type": "object",'), "not valid JSON"),
    (p.JsonSchema(schema='{"$ref": "#/$defs/missing"}'), "missing"),
    (p.JsonSchema(schema='{"type": "string", "format": "no-such-format"}'), "no-such-format"),
    (p.ToolCallConstraint(functions=TOOLS, mode="named", name="nope"), "nope"),
    (p.ToolCallConstraint(functions=(), mode="required"), "tools"),
    (p.LarkGrammar(lark="start: ("), "grammar"),
])
def test_an_invalid_constraint_fails_its_request_clearly_and_the_engine_serves_on(loaded, spec, named):
    engine = engine_for(loaded)
    prompt = json_prompts(engine, 1)[0]
    engine.submit_generate(Generate(request_id="bad", prompt="Hello", max_tokens=8, constraint=spec))
    engine.submit("good", prompt, max_tokens=8)
    runs = run_wide(engine)
    failed = end_of(runs["bad"])
    assert isinstance(failed, Failed) and failed.code == "invalid_constraint"
    assert named in failed.message
    assert isinstance(end_of(runs["good"]), Finished)


def test_unstrict_schema_ignores_what_it_cannot_enforce(loaded):
    model, tokenizer = loaded
    factory = ConstraintFactory(tokenizer, model.args.vocab_size)
    with pytest.raises(ConstraintError):
        factory.build(p.JsonSchema(schema='{"type": "string", "format": "no-such-format"}'), 16)
    factory.build(p.JsonSchema(schema='{"type": "string", "format": "no-such-format"}', strict=False), 16)


def test_an_unconstrained_request_beside_a_constrained_one_is_token_identical(loaded):
    alone = engine_for(loaded)
    prompt = alone.encode_prompt("Once upon a time")
    alone.submit("free", prompt, max_tokens=40)
    expected = run_wide(alone)["free"]

    engine = engine_for(loaded)
    spec = p.JsonSchema(schema=json.dumps(PERSON))
    engine.submit("c1", json_prompts(engine, 1)[0], max_tokens=80, temperature=1.0, seed=3, constraint=spec)
    engine.submit("free", prompt, max_tokens=40)
    engine.submit("c2", json_prompts(engine, 2)[1], max_tokens=60, constraint=p.JsonObject())
    runs = run_wide(engine)
    tokens = [ev.token_id for ev in runs["free"] if isinstance(ev, TokenOut)]
    assert tokens == [ev.token_id for ev in expected if isinstance(ev, TokenOut)]
    assert text_of(runs["free"]) == text_of(expected)


def test_a_lark_grammar_is_enforced(loaded):
    engine = engine_for(loaded)
    spec = p.LarkGrammar(lark='start: ("yes" | "no") " " NUM\nNUM: /[0-9]{1,3}/')
    for i, prompt in enumerate(json_prompts(engine, 4)):
        engine.submit(f"g{i}", prompt, max_tokens=20, temperature=1.0, seed=i, constraint=spec)
    runs = run_wide(engine)
    for i in range(4):
        word, number = text_of(runs[f"g{i}"]).split(" ")
        assert word in ("yes", "no") and number.isdigit() and len(number) <= 3


def test_constraint_rides_the_wire_and_is_a_cache_key():
    codec = p.Codec(p.CommandMsg)
    cmd = Generate(request_id="r", prompt="x", constraint=p.ToolCallConstraint(functions=TOOLS, mode="named", name="add"))
    back = codec.decode(codec.encode(cmd))
    assert back == cmd and hash(back.constraint) == hash(cmd.constraint)
    assert codec.decode(codec.encode(Generate(request_id="r", prompt="x"))).constraint is None


def test_parallel_required_tool_calls_allow_several_calls_named_exactly_one():
    many, _ = tool_call_schema(p.ToolCallConstraint(functions=TOOLS, mode="required", parallel=True))
    one, _ = tool_call_schema(p.ToolCallConstraint(functions=TOOLS, mode="named", name="add", parallel=True))
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    jsonschema.validate([call, call], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], one)


SUCCESS = {"type": "object", "properties": {"success": {"type": "boolean", "const": True}}}  # no additionalProperties


def test_required_tool_arguments_take_only_the_declared_properties(loaded):
    """SmolLM2 with a required call whose one parameter is `success` wrote
    `{"success":true,"description":"test","type":"object",...` until max_tokens: JSON Schema
    lets an object carry undeclared properties, and the grammar let them through. Closed to
    the declared ones (as llama.cpp's grammar is), and one call unless parallel calls were
    asked for, a random-weight model's only way out is the one call, closed within 48 tokens."""
    engine = engine_for(loaded)
    spec = p.ToolCallConstraint(functions=(p.ToolFunction(name="done", parameters=json.dumps(SUCCESS),
                                                          strict=False),), mode="required")
    for i, prompt in enumerate(json_prompts(engine, 6)):
        engine.submit(f"t{i}", prompt, max_tokens=48, temperature=1.0, seed=i, constraint=spec)
    runs = run_wide(engine)
    for i in range(6):  # `success` is not required: `{}` is the other way out
        assert text_of(runs[f"t{i}"]) in ('[{"name":"done","arguments":{"success":true}}]',
                                        '[{"name":"done","arguments":{}}]')
        assert end_of(runs[f"t{i}"]).finish_reason == "stop"


def test_closed_properties_close_only_what_the_schema_leaves_open():
    schema = {"type": "object", "properties": {
        "loc": {"type": "object", "properties": {"city": {"type": "string"}}},
        "meta": {"type": "object", "additionalProperties": True, "properties": {"a": {"type": "string"}}},
        "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
        "any": {"type": "object"},
        "list": {"type": "array", "items": {"properties": {"x": {"type": "integer"}}}},
        "either": {"anyOf": [{"properties": {"p": {"type": "string"}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"q": {"type": "string"}}}, {"properties": {"r": {"type": "string"}}}]},
        "ref": {"$ref": "#/$defs/point"},
        "const": {"const": {"properties": {"kept": 1}}}},
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    closed = closed_properties(schema)
    ok = {"loc": {"city": "x"}, "meta": {"a": "y", "b": 1}, "tags": {"t": 1}, "any": {"z": []},
          "list": [{"x": 1}], "either": {"p": "s"}, "both": {"q": "1", "r": "2"}, "ref": {"x": 1.5},
          "const": {"properties": {"kept": 1}}}
    jsonschema.validate(ok, closed)
    for extra in ({"extra": 1}, {"loc": {"city": "x", "description": "copied"}}, {"list": [{"x": 1, "y": 2}]},
                  {"either": {"p": "s", "type": "object"}}, {"ref": {"x": 1, "y": 2}}):
        jsonschema.validate(extra, schema)  # the schema as given allowed it
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, closed)
    assert schema["properties"]["loc"] == {"type": "object", "properties": {"city": {"type": "string"}}}


def test_a_required_call_is_one_call_unless_parallel_calls_are_asked_for():
    from supervisor.http.anthropic import MessagesRequest, messages_generate
    from supervisor.http.openai import chat_generate
    from supervisor.http.openai_types import ChatRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": SUCCESS}}]

    def chat(**kw):
        req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
                               "tool_choice": "required", **kw}, ChatRequest)
        return chat_generate(req).gen.constraint.parallel

    def messages(**kw):
        req = msgspec.convert({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"name": "f", "input_schema": SUCCESS}],
                               "tool_choice": {"type": "any", **kw}}, MessagesRequest)
        return messages_generate(req).gen.constraint.parallel

    assert (chat(), chat(parallel_tool_calls=False), chat(parallel_tool_calls=True)) == (False, False, True)
    assert (messages(), messages(disable_parallel_tool_use=True),
            messages(disable_parallel_tool_use=False)) == (False, False, True)


def test_a_refused_token_is_flagged_not_raised(loaded):
    model, tokenizer = loaded
    constraint = ConstraintFactory(tokenizer, model.args.vocab_size).build(p.JsonObject(), 16)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert constraint.accept(letter) is False  # a JSON object cannot start with x
    assert "broke the output constraint" in constraint.error and not constraint.done


def test_a_budget_below_the_shortest_closing_json_is_refused_before_any_token(loaded):
    """A one-token json_object ended as `{`, which does not parse: now the request is refused,
    naming max_tokens and the shortest budget that closes (`{}`: 2 tokens)."""
    engine = engine_for(loaded)
    engine.submit_generate(Generate(request_id="one", prompt="Hello", max_tokens=1, constraint=p.JsonObject()))
    end = end_of(run_wide(engine)["one"])
    assert isinstance(end, Failed) and end.code == "invalid_constraint"
    assert "max_tokens (1)" in end.message and "at least 2" in end.message


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_object_parses_at_every_budget_from_the_shortest_up(loaded, temperature):
    """max_tokens 4-6 gave `{"":` .. `{"":""`: one free token (`"` opening a key) raised the
    closing count by four while the wrap-up assumed one. Every budget from 2 up parses."""
    engine = engine_for(loaded)
    budgets = list(range(2, 17)) + [24, 40]
    for n in budgets:
        for seed in range(3):
            engine.submit(f"{n}-{seed}", engine.encode_prompt(f"Reply in JSON {seed}:"), max_tokens=n,
                          temperature=temperature, seed=seed, constraint=p.JsonObject())
    runs = run_wide(engine)
    for n in budgets:
        for seed in range(3):
            events = runs[f"{n}-{seed}"]
            assert isinstance(json.loads(text_of(events)), dict), (n, seed, text_of(events))
            assert end_of(events).completion_tokens <= n


# ---------------------------------------------------------------------------
# a constraint that cannot be enforced is refused before any token, never a 500 mid-stream

EXPLODING = "^(a|aa){1000}$"  # llguidance's lexer runs out of fuel the moment it enters this string


@pytest.mark.parametrize("spec, where", [
    (p.JsonSchema(schema=json.dumps({"type": "string", "pattern": EXPLODING})), "pattern"),
    (p.JsonSchema(schema=json.dumps({"type": "object", "properties": {"id": {"type": "string", "pattern": EXPLODING}},
                                     "required": ["id"]})), "pattern"),
    (p.JsonSchema(schema=json.dumps({"type": "object", "properties": {"n": {"type": "integer"},
                                     "id": {"type": "string", "pattern": EXPLODING}}})), "pattern"),  # optional
    (p.ToolCallConstraint(functions=(p.ToolFunction(name="f", parameters=json.dumps(
        {"type": "object", "properties": {"v": {"type": "string", "pattern": EXPLODING}}})),),
        mode="required"), "tools[f].parameters"),
])
def test_an_exploding_pattern_is_refused_at_compile_not_mid_stream(loaded, spec, where):
    model, tokenizer = loaded
    factory = ConstraintFactory(tokenizer, model.args.vocab_size)
    with pytest.raises(ConstraintError) as refused:
        factory.build(spec, 64)
    assert refused.value.code == "invalid_constraint"
    assert where in refused.value.message and EXPLODING in refused.value.message
    with pytest.raises(ConstraintError):  # the refusal is cached, and still raised
        factory.build(spec, 64)


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
])
def test_an_unsatisfiable_schema_fails_before_any_token(loaded, schema):
    engine = engine_for(loaded)
    engine.submit_generate(Generate(request_id="u", prompt="Hello", max_tokens=8,
                                    constraint=p.JsonSchema(schema=json.dumps(schema))))
    events = run_wide(engine)["u"]
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].code == "invalid_constraint"
    assert "Unsatisfiable" in events[0].message


def test_an_exploding_pattern_fails_its_request_before_any_token(loaded):
    engine = engine_for(loaded)
    spec = p.JsonSchema(schema=json.dumps({"type": "object", "properties": {"x": {"type": "string",
                                                                                  "pattern": EXPLODING}},
                                           "required": ["x"]}))
    engine.submit_generate(Generate(request_id="x", prompt="Hello", max_tokens=32, constraint=spec))
    events = run_wide(engine)["x"]
    assert [type(ev) for ev in events] == [Failed] and events[0].code == "invalid_constraint"


def test_patterns_that_work_still_compile(loaded):
    model, tokenizer = loaded
    factory = ConstraintFactory(tokenizer, model.args.vocab_size)
    many = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{1,4}$"}
                                             for i in range(30)},
            "patternProperties": {"^x-": {"type": "string", "pattern": "^(a|aa){200}$"}}}
    for schema in (PERSON, many):
        factory.build(p.JsonSchema(schema=json.dumps(schema)), 64)
