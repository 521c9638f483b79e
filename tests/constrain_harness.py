"""The tool schema the constrained-decoding tests share (no tests here)."""

from __future__ import annotations

import json

from shared import protocol as p

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}


ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
       "required": ["a", "b"], "additionalProperties": False}


TOOLS = (p.ToolFunction(name="get_weather", parameters=json.dumps(WEATHER)),
         p.ToolFunction(name="add", parameters=json.dumps(ADD)))
