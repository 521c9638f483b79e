"""Through real HTTP and a real worker: a schema the worker cannot enforce (a
pattern whose regex explodes, an unsatisfiable schema) is a 400 naming the field that
carried it, before any token, on chat (response_format, tools), Responses (text.format,
tools) and Anthropic (tools), streamed or not. Before: a 500 mid-stream, or a 200 with "".
"""

from __future__ import annotations

import pytest

# `server` (the tiny model as "a") and no_front_door_errors are conftest.py's
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

EXPLODING = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a|aa){1000}$"}},
             "required": ["x"]}
UNSATISFIABLE = {"type": "string", "minLength": 5, "maxLength": 2}
CONFLICT = {"allOf": [{"type": "string"}, {"type": "integer"}]}
SCHEMAS = {"exploding": EXPLODING, "unsatisfiable": UNSATISFIABLE, "conflict": CONFLICT}
HI = [{"role": "user", "content": "hi"}]


def _tool(schema: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": schema}, "required": ["v"]}}}


def _requests(schema: dict, stream: bool) -> list[tuple[str, dict, str]]:
    """(path, body, the param the 400 must name) for each API that carries a schema."""
    return [
        ("/v1/chat/completions", {"model": "a", "messages": HI, "max_tokens": 16, "stream": stream,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "o", "schema": schema}}},
         "response_format"),
        ("/v1/chat/completions", {"model": "a", "messages": HI, "max_tokens": 16, "stream": stream,
                                  "tools": [_tool(schema)], "tool_choice": "required"}, "tools"),
        ("/v1/responses", {"model": "a", "input": "hi", "max_output_tokens": 16, "stream": stream,
                           "text": {"format": {"type": "json_schema", "name": "o", "schema": schema}}},
         "text.format"),
        ("/v1/responses", {"model": "a", "input": "hi", "max_output_tokens": 16, "stream": stream,
                           "tools": [{"type": "function", "name": "f", "parameters": _tool(schema)["function"]
                                      ["parameters"]}], "tool_choice": "required"}, "tools"),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_schema_that_cannot_be_enforced_is_a_400_before_any_token(server, name, stream):
    async def main():
        answers = []
        async with server.client() as client:
            for path, body, param in _requests(SCHEMAS[name], stream):
                r = await client.post(path, json=body)
                answers.append((path, param, r.status_code, r.headers.get("content-type", ""), r.json()
                                if r.headers.get("content-type", "").startswith("application/json") else r.text))
        return answers

    for path, param, status, ctype, body in server.run(main()):
        assert (path, status, ctype) == (path, 400, "application/json"), body
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (path, error)
        assert "cannot be enforced" in error["message"] and error["code"] == "invalid_constraint"
