"""Fill-in-the-middle token spellings: which a tokenizer has, and in what order
a prompt puts the prefix and the suffix.

Why in `shared/`: the supervisor reads a model's small files (or a GGUF header) to
say on its cards whether it can fill in the middle (Ollama's `insert`
capability) and to refuse a `suffix` early; the worker builds the prompt from
its tokenizer. Both decide with this one table, so a card never promises what
the worker then refuses.

A code model trained for FIM completes `PRE prefix SUF suffix MID` with the
middle; some (Codestral) read the suffix first and have no middle token.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import msgspec

from shared.vocab import FailureCode

# The worker's Failed code for a suffix sent to a model whose tokenizer has no FIM tokens
# (the front door answers it as a 400 naming `suffix`).
FIM_UNSUPPORTED: FailureCode = "fim_unsupported"


class FimTokens(msgspec.Struct, frozen=True, kw_only=True):
    prefix: str
    suffix: str
    middle: str = ""  # "": none (the prompt ends after the prefix)
    order: Literal["psm", "spm"] = "psm"  # prefix-suffix-middle, or suffix-prefix-middle

    def tokens(self) -> tuple[str, ...]:
        return tuple(t for t in (self.prefix, self.suffix, self.middle) if t)


# In order of preference; the first whose tokens a vocabulary has all of wins.
SPELLINGS: tuple[FimTokens, ...] = (
    FimTokens(prefix="<|fim_prefix|>", suffix="<|fim_suffix|>", middle="<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3
    FimTokens(prefix="<fim_prefix>", suffix="<fim_suffix>", middle="<fim_middle>"),  # StarCoder, SmolLM, Granite
    FimTokens(prefix="<fim-prefix>", suffix="<fim-suffix>", middle="<fim-middle>"),  # SantaCoder
    FimTokens(prefix="<｜fim▁begin｜>", suffix="<｜fim▁hole｜>", middle="<｜fim▁end｜>"),  # DeepSeek-Coder
    FimTokens(prefix="<|code_prefix|>", suffix="<|code_suffix|>", middle="<|code_middle|>"),  # CodeGeeX, GLM-4
    FimTokens(prefix="▁<PRE>", suffix="▁<SUF>", middle="▁<MID>"),  # CodeLlama (SentencePiece)
    FimTokens(prefix="<PRE>", suffix="<SUF>", middle="<MID>"),  # CodeLlama as GGUF names them
    FimTokens(prefix="[PREFIX]", suffix="[SUFFIX]", order="spm"),  # Codestral
)


def find(vocabulary: Collection[str]) -> FimTokens | None:
    """The FIM spelling whose every token is in `vocabulary` (a tokenizer's added or special
    tokens suffice: FIM tokens are always among them), or None."""
    for spelling in SPELLINGS:
        if all(t in vocabulary for t in spelling.tokens()):
            return spelling
    return None
