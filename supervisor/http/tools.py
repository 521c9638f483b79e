"""Tool calling and structured output, shared by the three APIs.

Each API (OpenAI chat, Anthropic Messages, OpenAI Responses) spells tools
and tool_choice its own way; they all come down to a `ToolPlan`: the
functions, what the model must do (`auto`, `none`, `required`, `named`) and
whether several calls may come at once. The plan gives the worker

  * the tools as JSON text for the model's chat template (`Generate.tools`),
    so the model is told about them the way it was trained to be;
  * for `required` and `named`, a `ToolCallConstraint`: the worker's
    constrained decoding then emits exactly `[{"name": ..., "arguments":
    {...}}]`, valid against the function's schema even on a random-weight
    demo model, which `parse_constrained` reads with msgspec;

and for `auto` the reply is read for Hermes/Qwen-style calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what the demo
models' template and Qwen/SmolLM-family templates ask for) by
`parse_tagged`. A call is recognised only when the reply *opens* with one
(so a streamed reply can be told apart after a few characters); a model that
calls tools in another format gets its text back as content, never a guess.
(mlx-lm's per-family parsers import MLX, which the supervisor never does.)
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal, NamedTuple, Union

import msgspec

from shared import protocol as p
from supervisor.http.openai_types import BodyError

Choice = Literal["auto", "none", "required", "named"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_encoder = msgspec.json.Encoder()


class Function(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'  # JSON Schema text
    strict: bool = False


class ToolPlan(msgspec.Struct, kw_only=True):
    functions: list[Function]
    choice: Choice = "auto"
    named: str = ""
    # A required call is one call unless the request asks for several (OpenAI's
    # `parallel_tool_calls: true`, Anthropic's `disable_parallel_tool_use: false`), as
    # llama.cpp decides: left to the grammar, a small model that could go on calling did,
    # until max_tokens, though both APIs would allow several when the field is absent.
    parallel: bool = False

    def template_tools(self) -> str:
        """The tools as HF chat templates read them (OpenAI's chat shape)."""
        return _encoder.encode([
            {"type": "function", "function": {"name": f.name, "description": f.description,
                                              "parameters": msgspec.json.decode(f.parameters)}}
            for f in self.functions]).decode()

    def constraint(self) -> p.ToolCallConstraint | None:
        """required / named: the worker must emit the call list (constrained decoding)."""
        if self.choice not in ("required", "named"):
            return None
        fns = tuple(p.ToolFunction(name=f.name, parameters=f.parameters, strict=f.strict) for f in self.functions)
        return p.ToolCallConstraint(functions=fns, mode=self.choice, name=self.named,
                          parallel=self.parallel and self.choice == "required")

    @property
    def mode(self) -> str:
        """How the reply is read: `constrained` (a call list), `auto` (tagged calls) or `text`."""
        if self.choice in ("required", "named"):
            return "constrained"
        return "auto" if self.choice == "auto" and self.functions else "text"


def function(name: Any, description: Any, parameters: Any, strict: Any, where: str) -> Function:
    """One function definition, checked the same way for every API."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise BodyError(f"{where}.name: must be 1-64 letters, digits, _ . : or -", param=f"{where}.name")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise BodyError(f"{where}: the parameters must be a JSON Schema object", param=where)
    return Function(name=name, description=description if isinstance(description, str) else "",
                    parameters=_encoder.encode(parameters).decode(), strict=bool(strict))


_CHOICES: dict[str, Choice] = {"auto": "auto", "none": "none", "required": "required"}
ANTHROPIC_CHOICES: dict[str, Choice] = {"auto": "auto", "none": "none", "any": "required", "tool": "named"}


def openai_choice(tool_choice: Any, nested: bool) -> tuple[Choice, str]:
    """OpenAI's tool_choice -> (choice, named function). Chat nests the name under
    `function` (`nested`); Responses puts it beside `type`."""
    if tool_choice is None:
        return "auto", ""
    if isinstance(tool_choice, str) and tool_choice in _CHOICES:
        return _CHOICES[tool_choice], ""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        holder = tool_choice.get("function") if nested else tool_choice
        if isinstance(holder, dict) and isinstance(holder.get("name"), str):
            return "named", holder["name"]
    shape = '{"type": "function", "function": {"name": ...}}' if nested else '{"type": "function", "name": ...}'
    raise BodyError(f"tool_choice: expected none, auto, required or {shape}", param="tool_choice")


def check_named(plan: ToolPlan, param: str) -> ToolPlan:
    if plan.choice == "named" and plan.named not in {f.name for f in plan.functions}:
        raise BodyError(f"{param}: names the function {plan.named!r}, which is not among the tools", param=param)
    if plan.choice in ("required", "named") and not plan.functions:
        raise BodyError(f"{param}: a tool call is required but no tools were given", param=param)
    return plan


class Planned(NamedTuple):
    """A request as its API's translator made it: what the worker runs (`gen`, the plan's
    tools and constraint on it) and how its reply is read for calls (`plan`; None: as text)."""

    gen: p.Generate
    plan: ToolPlan | None = None


def planned(gen: p.Generate, plan: ToolPlan | None) -> Planned:
    """The plan, applied to `gen` once: its tools for the chat template and, for
    required/named, its constraint (a JSON output format cannot be enforced beside it)."""
    if plan is None:
        return Planned(gen)
    call = plan.constraint()
    if call is not None and gen.constraint is not None:
        raise BodyError("tool_choice: a required tool call and a JSON output format cannot both be "
                        "enforced on one reply; drop one", param="tool_choice")
    gen.tools = plan.template_tools() if plan.functions else None
    gen.constraint = call or gen.constraint
    return Planned(gen, plan)


# ---------------------------------------------------------------------------
# reading the reply


class Call(msgspec.Struct, kw_only=True):
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class _Raw(msgspec.Struct):
    name: str
    arguments: Union[dict[str, Any], None] = None
    parameters: Union[dict[str, Any], None] = None  # some models say parameters


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(raw: _Raw) -> Call:
    args = raw.arguments if raw.arguments is not None else (raw.parameters or {})
    return Call(id=new_call_id(), name=raw.name, arguments=_encoder.encode(args).decode())


def parse_constrained(text: str) -> list[Call] | None:
    """The `ToolCallConstraint`'s output: the calls, or None when not even one is whole.

    Cut short by max_tokens (the worker's wrap-up cannot always close a
    long call list in time), the calls completed before the cut are kept:
    the finish_reason ("length") tells the client the list may go on."""
    for candidate in (text, *_whole_prefixes(text)):
        try:
            calls = [_call(r) for r in msgspec.json.decode(candidate, type=list[_Raw])]
        except msgspec.DecodeError:
            continue
        return calls or None
    return None


def _whole_prefixes(text: str) -> list[str]:
    """`[a, b, <cut>` -> ["[a, b]", "[a]"]: the array closed after each whole element, longest first."""
    ends, depth, in_str, escaped = [], 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 1:
                ends.append(i + 1)
    return [text[:end] + "]" for end in reversed(ends)]


def opens_with_call(text: str) -> bool | None:
    """True/False once the start of the reply tells; None while it could still be a call."""
    head = text.lstrip()
    if head.startswith(CALL_OPEN):
        return True
    return None if CALL_OPEN.startswith(head) else False


def parse_tagged(text: str) -> tuple[str, list[Call]]:
    """`<tool_call>{...}</tool_call>` blocks -> calls; what is not a valid call stays text."""
    if not opens_with_call(text):
        return text, []
    calls: list[Call] = []
    rest = text.lstrip()
    while rest.startswith(CALL_OPEN):
        body, sep, after = rest[len(CALL_OPEN):].partition(CALL_CLOSE)
        try:
            calls.append(_call(msgspec.json.decode(body.strip(), type=_Raw)))
        except msgspec.DecodeError:
            break
        rest = after.lstrip()
        if not sep:
            break
    if not calls:
        return text, []
    return rest, calls
