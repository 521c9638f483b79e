"""The worker's tokenizer on request: `Tokenize` and `Detokenize` commands.

Why here: only the worker holds the model's tokenizer and chat template; the
front door's `/tokenize` and `/detokenize` (llama.cpp's routes) ask it. Each
answer is computed at once between two engine steps and is one reply frame:
`Tokenized` / `Detokenized`, or a `Failed` of the same request id naming what
is wrong with the input. Nothing here touches MLX.

Pieces are bytes, not text: a byte-level BPE token (GPT-2, Llama 3, Qwen, the
demo models) or an SPM byte-fallback token (`<0xC3>`) may hold part of a UTF-8
character, and llama.cpp shows such a piece as its byte values.
"""

from __future__ import annotations

import functools
import logging
import re

from tokenizers import decoders

from shared.protocol import Detokenize, Detokenized, Failed, Tokenize, Tokenized
from worker import prompts
from worker.request import ENGINE_ERROR, INVALID_REQUEST, EngineError

log = logging.getLogger("memvisor.worker")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each printable stand-in -> its byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


def piece_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token's bytes as the model emits them (an added or special token: its text)."""
    added = tokenizer.get_added_vocab()
    byte_level = _byte_level(tokenizer)
    table = _byte_of_char() if byte_level else {}
    out: list[bytes] = []
    for token in tokenizer.convert_ids_to_tokens(ids):
        token = token or ""
        hex_byte = _BYTE_TOKEN.fullmatch(token)
        if token in added:
            out.append(token.encode())
        elif byte_level and all(ch in table for ch in token):
            out.append(bytes(table[ch] for ch in token))
        elif hex_byte:
            out.append(bytes([int(hex_byte[1], 16)]))
        else:
            out.append(token.replace(_SPM_SPACE, " ").encode())
    return out


def _encode(tokenizer, cmd: Tokenize) -> list[int]:
    if (cmd.text is None) == (cmd.messages is None):
        raise EngineError(INVALID_REQUEST, "give exactly one of text or messages to tokenize")
    if cmd.messages is not None:
        return prompts.encode_chat(tokenizer, cmd.messages, cmd.tools)
    return list(tokenizer.encode(cmd.text, add_special_tokens=cmd.add_special,
                                 split_special_tokens=not cmd.parse_special))


def tokenize(tokenizer, cmd: Tokenize) -> Tokenized | Failed:
    """The command's answer; never raises (it runs in the worker's command loop, where an
    exception would end every request of this model)."""
    try:
        ids = _encode(tokenizer, cmd)
        pieces = piece_bytes(tokenizer, ids) if cmd.with_pieces else []
    except EngineError as exc:
        return Failed(request_id=cmd.request_id, code=exc.code, message=exc.message)
    except Exception as exc:  # noqa: BLE001 - the tokenizer raises what it raises
        log.exception("tokenize %s failed", cmd.request_id)
        return Failed(request_id=cmd.request_id, code=ENGINE_ERROR, message=f"the tokenizer failed: {exc!r}")
    return Tokenized(request_id=cmd.request_id, tokens=ids, pieces=pieces)


def detokenize(tokenizer, cmd: Detokenize) -> Detokenized | Failed:
    """The tokens' text, special tokens included; an id outside the vocabulary is named."""
    vocab = len(tokenizer)
    bad = next((t for t in cmd.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        return Failed(request_id=cmd.request_id, code=INVALID_REQUEST,
                      message=f"token id {bad} is not in this model's vocabulary (0..{vocab - 1})")
    try:
        text = tokenizer.decode(cmd.tokens)
    except Exception as exc:  # noqa: BLE001 - as in tokenize
        log.exception("detokenize %s failed", cmd.request_id)
        return Failed(request_id=cmd.request_id, code=ENGINE_ERROR, message=f"the tokenizer failed: {exc!r}")
    return Detokenized(request_id=cmd.request_id, text=text)
