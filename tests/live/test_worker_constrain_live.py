"""Constrained decoding in a real worker process: a constraint that rides the wire is
enforced, and a bad one fails its request without the worker; and the engine's twenty
constrained replies in a row (tests/test_constrain.py holds the engine's fast side)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shared import protocol as p
from shared.protocol import Failed, Finished, Generate, TokenOut
from tests.constrain_harness import PERSON, TOOLS, WEATHER, end_of, json_prompts, run_wide, text_of
from tests.engine_harness import engine_for
from tests.worker_harness import FakeSupervisor

pytestmark = pytest.mark.slow


def test_a_worker_process_enforces_a_wire_constraint_and_refuses_a_bad_one(tiny_model, tmp_path):
    with FakeSupervisor(tmp_path, tiny_model, "w#c") as sup:
        sup.recv(p.Loaded)
        sup.send(Generate(request_id="bad", prompt="hi", max_tokens=8,
                          constraint=p.JsonSchema(schema='{"type": "strnig"}')))
        failed = sup.recv(Failed)
        assert (failed.request_id, failed.code) == ("bad", "invalid_constraint") and "strnig" in failed.message
        sup.send(Generate(request_id="call", prompt="hi", max_tokens=96, temperature=1.0, seed=7,
                          constraint=p.ToolCallConstraint(functions=TOOLS, mode="named", name="get_weather")))
        text = []
        while True:
            msg = sup.recv((TokenOut, Finished, Failed))
            if not isinstance(msg, TokenOut):
                break
            text.append(msg.text)
        assert isinstance(msg, Finished)
        (call,) = json.loads("".join(text))
        jsonschema.validate(call["arguments"], WEATHER)
        assert sup.proc.is_alive()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schema_output_validates_20_of_20(loaded, temperature):
    engine = engine_for(loaded)
    spec = p.JsonSchema(schema=json.dumps(PERSON), name="person")
    for i, prompt in enumerate(json_prompts(engine, 20)):
        engine.submit(f"r{i}", prompt, max_tokens=96, temperature=temperature, seed=i, constraint=spec)
    runs = run_wide(engine)
    for i in range(20):
        assert isinstance(end_of(runs[f"r{i}"]), Finished)
        jsonschema.validate(json.loads(text_of(runs[f"r{i}"])), PERSON)
    assert engine._constraints.compiles == 1  # twenty requests, one compile

