"""The constrained output's closing policy: how the budget wrap-up ends a JSON in time.

`worker/constrain.py`'s `Constraint` asks, near the end of its budget, how many
tokens a fixed policy needs to close the output from the grammar's state
(`closing_cost`, a dry run on a copy of the matcher), which token that policy
takes (`pick`), and which tokens could still be afforded (`Closers.fits`): each
token's bound (`_jump_bound`) is the most it can add to that count in JSON, and
plain text inside a free string adds nothing. All found once per tokenizer
(`closers_for`).
"""

from __future__ import annotations

import llguidance as llg
import numpy as np


class Closers:
    """What the wrap-up prefers (see worker/constrain.py `Constraint`), found once per tokenizer."""

    __slots__ = ("bounds", "content", "eos", "lengths", "outside", "probe", "quote", "reach")

    def __init__(self, eos: tuple[int, ...], quote: int, probe: int, outside: tuple[int, ...],
                 lengths: np.ndarray, bounds: np.ndarray, content: np.ndarray):
        self.eos = eos
        self.quote = quote        # `"`: ends a free string
        self.probe = probe        # `x`: allowed only inside a free string
        self.outside = outside    # `]` `}` `,` `"` `0` `:` `[` `{`, in that order
        self.lengths = lengths    # bytes per token id (longest allowed token = most progress)
        self.bounds = bounds      # per token: the most it can add to the closing cost (`_jump_bound`)
        self.content = content    # per token: plain text inside a free string, which adds nothing
        self.reach = int(bounds.max(initial=0))  # below this margin a free token could overrun

    def fits(self, room: int, free: bool, n_words: int) -> np.ndarray:
        """The bitmask (llguidance's layout, `n_words` 32-bit words) of tokens that add at most
        `room` to the closing cost: in a free string, plain text adds nothing."""
        added = np.where(self.content, 0, self.bounds) if free else self.bounds
        bits = np.zeros(n_words * 32, dtype=bool)
        bits[:added.size] = added <= room
        return np.packbits(bits, bitorder="little").view(np.int32)


def closing_cost(matcher: llg.LLMatcher, closers: Closers, n_words: int, limit: int) -> int:
    """Tokens the closing policy needs from the matcher's state (limit + 1: not within limit),
    found on a copy."""
    sim = matcher.deep_copy()
    words = np.zeros(n_words, dtype=np.int32)
    for used in range(limit):
        if sim.is_stopped():
            return used
        sim.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        token = pick(closers, words)
        if token is None or not sim.consume_token(token):
            return limit + 1
        if token in closers.eos:
            return used + 1
    return limit if sim.is_stopped() else limit + 1


def _allowed(words: np.ndarray, token: int) -> bool:
    return token >= 0 and (int(words[token >> 5]) >> (token & 31)) & 1 == 1


def in_free_string(closers: Closers, words: np.ndarray) -> bool:
    """Inside a string that any text may continue and a quote may end."""
    return _allowed(words, closers.probe) and _allowed(words, closers.quote)


def pick(closers: Closers, words: np.ndarray) -> int | None:
    """The closing policy's token in the state whose mask is `words` (see `Constraint`)."""
    for token in closers.eos:
        if _allowed(words, token):
            return token
    in_string = _allowed(words, closers.probe)
    if in_string and _allowed(words, closers.quote):
        return closers.quote
    if not in_string:
        for token in closers.outside:
            if _allowed(words, token):
                return token
    bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=closers.lengths.size)
    scores = np.where(bits.astype(bool), closers.lengths, -1)
    best = int(scores.argmax())
    return best if scores[best] >= 0 else None


def closers_for(backend, eos: list[int], tokenizer: llg.LLTokenizer, vocab: int) -> Closers:
    def tid(text: str) -> int:
        found = backend.token_to_id(text)
        return -1 if found is None else found

    texts = [b"" if tokenizer.is_special_token(i) else tokenizer.decode_bytes([i])
             for i in range(min(vocab, tokenizer.vocab_size))]
    lengths = np.pad(np.array([len(t) for t in texts], dtype=np.int32), (0, vocab - len(texts)))
    bounds = np.pad(np.array([_jump_bound(t) for t in texts], dtype=np.int32), (0, vocab - len(texts)))
    content = np.pad(np.array([_plain_text(t) for t in texts], dtype=bool), (0, vocab - len(texts)))
    return Closers(eos=tuple(eos), quote=tid('"'), probe=tid("x"),
                   outside=tuple(tid(c) for c in ("]", "}", ",", '"', "0", ":", "[", "{")),
                   lengths=lengths, bounds=bounds, content=content)


# The most one byte adds to the closing policy's count in JSON: `,` opens a key that needs
# `"` `"` `:` `"` `"` (5); `"` opening a key needs `"` `:` `"` `"` (4); a letter starts
# `false` (4 to go) or a `\u` escape (4 hex digits); a UTF-8 lead byte leaves up to 3
# bytes to come; any other byte (`[`, `{`, `-`, `.`, a backslash, a digit) adds at most 1.
_BYTE_BOUNDS = np.array([5 if b == ord(",") else 4 if b == ord('"') or chr(b).isascii() and chr(b).isalpha()
                         else 3 if b >= 0x80 else 1 for b in range(256)], dtype=np.int32)


def _jump_bound(text: bytes) -> int:
    """The most a token of these bytes adds to the closing cost, wherever JSON allows it."""
    return int(_BYTE_BOUNDS[np.frombuffer(text, dtype=np.uint8)].sum())


def _plain_text(text: bytes) -> bool:
    """Whole UTF-8 characters with no quote, backslash or control character: inside a free
    string it leaves the closing cost as it was (the same quote still ends the string)."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(decoded) and not any(c in '"\\' or ord(c) < 0x20 for c in decoded)
