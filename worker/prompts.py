"""Prompt rendering: chat turns through the model's template, tools, BOS.

Nothing here runs the model; the engine calls these to turn a wire
`Generate` into prompt tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from shared import fim
from worker.request import INVALID_REQUEST, EngineError


def _turn(m, images: bool = False) -> dict:
    """A wire ChatMessage as the dict HF chat templates read (tool turns too); with `images`, a
    turn with parts gets them as the content list vision templates read (text and image parts)."""
    turn: dict = {"role": m.role, "content": m.content}
    if images and m.parts:
        turn["content"] = [{"type": "image"} if part.image is not None else {"type": "text", "text": part.text or ""}
                           for part in m.parts]
    if m.tool_calls:
        turn["tool_calls"] = json.loads(m.tool_calls)
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _knows_tools(template) -> bool:
    """A chat template that reads `tools` renders them itself (Qwen, Llama 3.1+, Hermes ...)."""
    text = template if isinstance(template, str) else json.dumps(template)
    return "tools" in text


TOOLS_IN_WORDS = ("You can call these tools. To call one, answer with "
                  '<tool_call>{"name": <name>, "arguments": <object>}</tool_call>\n<tools>\n{tools}</tools>')


def _tools_in_words(turns: list[dict], tools: list) -> list[dict]:
    """For a template with no place for tools, the Hermes wording the front door
    parses, in the system turn; earlier calls and results become plain text turns."""
    listing = TOOLS_IN_WORDS.replace("{tools}", "".join(json.dumps(t) + "\n" for t in tools))
    out: list[dict] = []
    for t in turns:
        if t.get("tool_calls"):
            calls = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                         "arguments": c["function"]["arguments"]}) + "</tool_call>"
                            for c in t["tool_calls"])
            out.append({"role": "assistant", "content": calls})
        elif t["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{t['content']}</tool_response>"})
        else:
            out.append({"role": t["role"], "content": t["content"]})
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": listing + "\n\n" + out[0]["content"]}] + out[1:]
    return [{"role": "system", "content": listing}] + out


def encode_chat(tokenizer, messages: Iterable, tools: str | None = None) -> list[int]:
    """Chat messages through the model's chat template, ready for the reply."""
    return list(_apply_template(tokenizer, messages, tools))


def render_chat(tokenizer, messages: Iterable, tools: str | None = None) -> str:
    """The same as text, images as the template marks them (a vision model's processor expands the
    marks into image tokens: worker/vision.py)."""
    return str(_apply_template(tokenizer, messages, tools, images=True))


def _apply_template(tokenizer, messages: Iterable, tools: str | None, images: bool = False):
    if not tokenizer.has_chat_template:
        raise EngineError(INVALID_REQUEST, "this model has no chat template; use completions")
    turns = [m if isinstance(m, dict) else _turn(m, images) for m in messages]
    if not turns:
        raise EngineError(INVALID_REQUEST, "messages must not be empty")
    extra: dict = {}
    if tools:  # tools through the template, or in words where it has no place for them
        tool_list = json.loads(tools)
        if _knows_tools(getattr(tokenizer, "chat_template", None)):
            extra["tools"] = tool_list
        else:
            turns = _tools_in_words(turns, tool_list)
    if images:
        extra["tokenize"] = False
    try:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, **extra)
    except Exception as exc:  # noqa: BLE001 - jinja raises whatever the template says
        raise EngineError(INVALID_REQUEST, f"chat template rejected the messages: {exc}") from None


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A raw completion prompt; BOS added unless the text already starts with it."""
    bos = tokenizer.bos_token
    add_special = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def encode_fim(tokenizer, prefix: str, suffix: str) -> list[int]:
    """A fill-in-the-middle prompt, from the tokenizer's own FIM tokens
    (shared.fim; the supervisor's model cards read the same added tokens). The texts are
    tokenized with special-token text kept as text, so a prefix or suffix cannot smuggle
    in a FIM token; the BOS comes first when the tokenizer adds one."""
    spelling = fim.find(tokenizer.get_added_vocab())
    if spelling is None:
        raise EngineError(fim.FIM_UNSUPPORTED, "suffix: this model's tokenizer has no fill-in-the-middle tokens, "
                                           "so it cannot complete between a prompt and a suffix")
    ids = tokenizer.convert_tokens_to_ids

    def text(part: str) -> list[int]:
        return list(tokenizer.encode(part, add_special_tokens=False, split_special_tokens=True)) if part else []

    plain, full = text("a"), list(tokenizer.encode("a", add_special_tokens=True))
    head = full[:len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []  # the BOS, if added
    before, after = [ids(spelling.prefix), *text(prefix)], [ids(spelling.suffix), *text(suffix)]
    body = before + after if spelling.order == "psm" else after + before
    return head + body + ([ids(spelling.middle)] if spelling.middle else [])
