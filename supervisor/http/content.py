"""A message's content as the text a text model reads, for all three APIs.

Chat completions, Anthropic's Messages and OpenAI's Responses each let a
message's content be a string or a list of typed parts ("blocks" in
Anthropic's words). Only text can reach these models, so the parts are
joined into one string, and a part of any other type (an image, a document,
a tool block where none may stand) is a 400 naming it, never dropped.
"""

from __future__ import annotations

from typing import Collection, Protocol, Sequence, Union

from supervisor.http.openai_types import BodyError


class Part(Protocol):
    """A content part as the APIs' request Structs decode it: its type and, for text, the text."""

    @property
    def type(self) -> str: ...

    @property
    def text(self) -> Union[str, None]: ...


def part_text(part: Part, where: str, kinds: Collection[str] = ("text",), noun: str = "parts") -> str:
    """The text of one part at `where` (its path in the body), whose type must be one of `kinds`."""
    if part.type not in kinds:
        raise BodyError(f"{where}: only text {noun} are supported here (got type {part.type!r})",
                        param=f"{where}.type")
    if part.text is None:
        raise BodyError(f"{where}.text: required", param=f"{where}.text")
    return part.text


def text_of(content: Union[str, Sequence[Part], None], where: str, kinds: Collection[str] = ("text",)) -> str:
    """`content` (a string, a list of parts, or nothing) as one string; `where` is its path in the body."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part_text(part, f"{where}[{j}]", kinds) for j, part in enumerate(content))
