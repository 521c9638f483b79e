"""Constrained decoding in a real worker process: a constraint that rides the wire is
enforced, and a bad one fails its request without the worker (tests/test_constrain.py
holds the engine's side)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shared import protocol as p
from shared.protocol import Failed, Finished, Generate, TokenOut
from tests.constrain_harness import TOOLS, WEATHER
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
