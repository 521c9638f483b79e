"""Batched prefill: requests that arrive together are prefilled in one forward pass.

Why: prefilled one at a time, the 32nd of 32 simultaneous requests waited
for 31 prefills before its first token (an H200 measured 0.14 s for the
first and 2.2 s for the last); one pass over several prompts costs little
more than over one where the pass is launch- or bandwidth-bound.

How: the prompts are left-padded to the longest (`PrefillGroup.length`),
so every row ends at the same position, and run through mlx-lm's
`BatchKVCache` a chunk of columns at a time; padding is masked out of
attention and each row's RoPE offset is its own, as in batched decode, so
greedy output stays token-identical to the request alone. The last column
(every row's last prompt token) gives the first tokens; each row then joins
the decode batch straight from the group's buffers (`row_kv` is a view, the
decode batch copies the row once).

The guard's rules stay per request and hold for the group: the engine
checks G1 for each member and for the sum of their estimates, sizes each
chunk with G2 for the group's tokens, and checks G3 after it; a group whose
step would not fit is `split` back into requests that go on alone with their
own KV (see worker/prefill.py). Everything here is MLX mechanics; the engine
decides who joins and what the guard allows.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache, KVCache

PAD_TOKEN = 0
MAX_PADDING = 1.5  # a group's padded tokens stay under this times its real tokens


def worth_padding(lengths: list[int], length: int) -> bool:
    """True when adding a prompt of `length` keeps the padding within MAX_PADDING."""
    longest = max([length, *lengths])
    return longest * (len(lengths) + 1) <= MAX_PADDING * (sum(lengths) + length)


class PrefillGroup:
    """Rows being prefilled together; `rows[i]` is a request, or None once it was aborted.

    An aborted row keeps its place (its columns are still computed) so that no
    other row's KV has to move; its output is dropped at the end.
    """

    def __init__(self, rows: list[Any], prompts: list[list[int]], layers: int) -> None:
        self.rows: list[Any] = list(rows)
        self.length = max(len(p) for p in prompts)
        self.pads = [self.length - len(p) for p in prompts]
        self.tokens = mx.array([[PAD_TOKEN] * pad + p for pad, p in zip(self.pads, prompts)])
        self.cache: list[BatchKVCache] = [BatchKVCache(self.pads) for _ in range(layers)]
        self.pos = 0  # columns already in the KV

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> list[Any]:
        return [row for row in self.rows if row is not None]

    @property
    def remaining(self) -> int:
        """Columns still to prefill before the last one (whose logits give the first tokens)."""
        return self.length - 1 - self.pos

    def real_tokens(self, columns: int) -> int:
        """Prompt tokens (not padding) in the next `columns` columns, over every row."""
        end = self.pos + columns
        return sum(max(0, end - max(self.pos, pad)) for pad in self.pads)

    def run_chunk(self, model, columns: int) -> None:
        """Columns `[pos, pos + columns)` of every row through the model, evaluated."""
        with mx.stream(generation_stream):
            model(self.tokens[:, self.pos:self.pos + columns], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.pos += columns

    def last_logits(self, model) -> mx.array:
        """Every row's last prompt token through the model: logits (rows, vocab), lazy."""
        assert self.remaining == 0, "the group is still prefilling"
        logits = model(self.tokens[:, self.length - 1:], cache=self.cache)[:, -1, :]
        self.pos = self.length
        return logits

    def row_kv(self, index: int) -> list[KVCache]:
        """Row `index`'s real positions as per-layer caches: views of the group's buffers."""
        pad = self.pads[index]
        out: list[KVCache] = []
        for layer in self.cache:
            assert layer.keys is not None and layer.values is not None
            cache = KVCache()
            held = max(0, self.pos - pad)
            if held:
                cache.keys = layer.keys[index:index + 1, :, pad:self.pos, :]
                cache.values = layer.values[index:index + 1, :, pad:self.pos, :]
                cache.offset = held
            out.append(cache)
        return out

    def split(self) -> list[tuple[Any, list[KVCache] | None, int]]:
        """The live rows with their own KV so far (copied out) and the prompt tokens it holds."""
        out: list[tuple[Any, list[KVCache] | None, int]] = []
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            held = max(0, self.pos - self.pads[i])
            if held == 0:
                out.append((row, None, 0))
                continue
            layers = self.row_kv(i)
            for cache in layers:
                assert cache.keys is not None and cache.values is not None
                cache.keys, cache.values = mx.contiguous(cache.keys), mx.contiguous(cache.values)
            mx.eval([(c.keys, c.values) for c in layers])
            out.append((row, layers, held))
        return out
