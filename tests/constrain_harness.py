"""What the constrained-decoding tests share: the tool and person schemas, and the engine run
wide open to the end (no tests here)."""

from __future__ import annotations

import json

from shared import protocol as p
from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from worker.engine import Engine

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}


ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
       "required": ["a", "b"], "additionalProperties": False}


TOOLS = (p.ToolFunction(name="get_weather", parameters=json.dumps(WEATHER)),
         p.ToolFunction(name="add", parameters=json.dumps(ADD)))


WIDE = Limits(max_concurrency=32)  # guard off, room for every request at once

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "address", "tags", "member"],
    "additionalProperties": False,
}


def run_wide(engine: Engine, max_steps: int = 5000) -> dict[str, list]:
    """Step the engine with room for 32 requests until it is idle: each request's events."""
    by_id: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return by_id
        for ev in engine.step(WIDE, lambda: 0):
            by_id.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("engine still busy")


def text_of(events: list) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, TokenOut))


def end_of(events: list):
    assert isinstance(events[-1], (Finished, Failed))
    return events[-1]


def json_prompts(engine: Engine, n: int) -> list[list[int]]:
    return [engine.encode_prompt(f"Reply in JSON, request number {i}:") for i in range(n)]
