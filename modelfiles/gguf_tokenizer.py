"""A Hugging Face fast tokenizer built from a GGUF file's own metadata.

Why: an imported model must tokenize exactly as llama.cpp does with the same
file, offline. llama.cpp's GPT-2 style vocabularies (`tokenizer.ggml.model =
"gpt2"`) carry the byte-level tokens, the merges, each token's type and the
pre-tokenizer's name (`tokenizer.ggml.pre`), which picks the split regex
llama.cpp applies (llama-vocab.cpp); this maps those onto `tokenizers`.
SentencePiece vocabularies (`"llama"`) are refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.gguf import GGUFError, GGUFHeader

CONTROL, USER_DEFINED = 3, 4

_GPT2 = "gpt2"
_DIGITS_THEN_GPT2 = "digits+gpt2"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2, "codeshell": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _pre_tokenizer(name: str):
    from tokenizers import Regex, pre_tokenizers

    kind = PRE_TOKENIZERS.get(name)
    if kind is None:
        raise GGUFError(f"tokenizer.ggml.pre {name!r} is not supported "
                        f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind in (_GPT2, _DIGITS_THEN_GPT2))
    if kind == _GPT2:
        return byte_level
    if kind == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"), byte_level])


def _token_id(header: GGUFHeader, key: str, count: int) -> int | None:
    value = header.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < count:
        raise GGUFError(f"{key} {value!r} is not a token id of this vocabulary ({count} tokens)")
    return value


def _context_length(header: GGUFHeader, default: int = 4096) -> int:
    """`llama.context_length` (a number when present: metadata values are unchecked `object`s)."""
    if "llama.context_length" not in header.metadata:
        return default
    return int(header.field("llama.context_length", (int, float)))


def build_tokenizer(header: GGUFHeader):
    """A `tokenizers.Tokenizer` equal to the file's vocabulary (gpt2 kind only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = header.field("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {kind!r} is not supported (gpt2 byte-level BPE is)")
    tokens = header.field("tokenizer.ggml.tokens", list)
    merges = [tuple(m.split(" ", 1)) for m in header.field("tokenizer.ggml.merges", list)]
    types = (header.field("tokenizer.ggml.token_type", list)
             if header.metadata.get("tokenizer.ggml.token_type") else [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(header.metadata.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind_ in zip(tokens, types) if kind_ == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED])
    bos = _token_id(header, "tokenizer.ggml.bos_token_id", len(tokens))
    if header.metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return tokenizer


def write_tokenizer(header: GGUFHeader, out: Path) -> list[int]:
    """tokenizer.json, tokenizer_config.json (chat template) and the special tokens; returns the EOS ids."""
    tokenizer = build_tokenizer(header)
    tokens = header.field("tokenizer.ggml.tokens", list)
    count = len(tokens)
    ids = {role: _token_id(header, f"tokenizer.ggml.{role}_token_id", count)
           for role in ("bos", "eos", "unknown", "padding", "eot")}
    if ids["eos"] is None:
        raise GGUFError("GGUF metadata has no 'tokenizer.ggml.eos_token_id'")
    tokenizer.save(str(out / "tokenizer.json"))
    names = {"bos_token": ids["bos"], "eos_token": ids["eos"], "unk_token": ids["unknown"],
             "pad_token": ids["padding"]}
    special = {key: tokens[value] for key, value in names.items() if value is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(header.metadata.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _context_length(header),
        **special,
    }
    template = header.metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return sorted({i for i in (ids["eos"], ids["eot"]) if i is not None})
