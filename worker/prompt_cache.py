"""The worker's prompt cache (SPEC H1-H4): KV state of recent prompts, by token prefix.

Why our own structure and not mlx_lm's `LRUPromptCache`: that one deep-copies
an entry on every fetch (a second full copy of the KV before the first new
token is computed), has no notion of an entry a running or queued request
relies on (H3 must never drop those), splits its LRU by message role, and it
has moved (from `mlx_lm.server` to `mlx_lm.models.cache`, beside its
`PromptTrie`) and changed shape between releases that our `mlx-lm>=0.30`
floor admits. What we keep from mlx_lm is the
KV cache class itself (`KVCache`: keys/values arrays plus an offset) and its
trimming idea: a cached sequence serves any prefix of itself.

How reuse stays safe. MLX's `KVCache.update_and_fetch` writes new tokens into
its arrays with slice assignment, so a request must never write into arrays
an entry holds. `fork()` therefore gives the request fresh arrays: the reused
prefix copied once into a buffer with room to grow, evaluated at once so the
copy is paid (and measured) before the first prefill chunk. The entry itself
is never touched.

Bytes are measured, not estimated: an entry weighs the `nbytes` of the arrays
it holds (H2), so the supervisor's C12 `used` is the sum of real buffers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class Entry:
    """One cached token sequence and the per-layer KV that encodes it."""

    __slots__ = ("layers", "nbytes", "pins", "tokens")

    def __init__(self, tokens: tuple[int, ...], layers: list[KVCache]):
        self.tokens = tokens
        self.layers = layers
        self.nbytes = sum(c.nbytes for c in layers)
        self.pins = 0  # requests (running or queued) that will reuse it


class Hit:
    """A lookup result: reuse `tokens` tokens of `entry` (which stays pinned until released)."""

    __slots__ = ("entry", "tokens")

    def __init__(self, entry: Entry, tokens: int):
        self.entry = entry
        self.tokens = tokens


def supports(layers: Sequence) -> bool:
    """Only plain attention KV can be cut at any prefix; others (rotating, SSM) are not cached."""
    return bool(layers) and all(type(c) is KVCache for c in layers)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Longest-prefix reuse, LRU drop over a byte cap, pinned entries never dropped.

    `cap` 0 means no prompt cache (H2: `hot_cache_max` = 0); a lookup then
    always misses and nothing is stored. A match shorter than `min_reuse`
    tokens is a miss: sharing a BOS token or a chat template's first few
    tokens saves nothing, and counting it as a use would keep a stale entry
    at the young end of the LRU.
    """

    def __init__(self, cap: int = 0, *, min_reuse: int = 1):
        self.cap = max(0, cap)
        self.min_reuse = max(1, min_reuse)
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0
        self._pinned = 0  # bytes of pinned entries, kept as pins change (read at every step)
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pinned_bytes(self) -> int:
        # issue 11: kept up to date, not summed: the worker reads it with every sample, once a
        # decode step, and a sum over every entry cost a batched step ~4% on a small model
        return self._pinned

    @property
    def releasable(self) -> int:
        """Bytes a shrink may take: entries no running or queued request relies on (H3)."""
        return self.nbytes - self.pinned_bytes

    # -- reuse ---------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int], limit: int) -> Hit | None:
        """The entry sharing the longest prefix with `prompt`, at most `limit` tokens, pinned.

        `limit` is len(prompt) - 1 for the engine: the last prompt token is
        always run, since its logits give the first output token.
        """
        if self.cap <= 0 or limit <= 0:
            return None
        best: Entry | None = None
        best_n = 0
        for entry in self._entries.values():
            n = min(_common_prefix(entry.tokens, prompt), limit)
            if n > best_n or (n == best_n and best is not None and entry.nbytes < best.nbytes):
                best, best_n = entry, n
        if best is None or best_n < self.min_reuse:
            self.misses += 1
            return None
        self.hits += 1
        if best.pins == 0:
            self._pinned += best.nbytes
        best.pins += 1
        self._entries.move_to_end(best.tokens)
        return Hit(best, best_n)

    def release(self, hit: Hit | None) -> None:
        """The request that pinned `hit` ended or looked again."""
        if hit is not None and hit.entry.pins > 0:
            hit.entry.pins -= 1
            if hit.entry.pins == 0 and self._entries.get(hit.entry.tokens) is hit.entry:
                self._pinned -= hit.entry.nbytes

    @staticmethod
    def fork(hit: Hit) -> list[KVCache]:
        """Fresh per-layer KV holding the hit's prefix, with room to grow (see module doc)."""
        n = hit.tokens
        out: list[KVCache] = []
        for layer in hit.entry.layers:
            fresh = KVCache()
            # a stored entry's layers are filled (mlx_lm types an empty KVCache's arrays as None)
            assert layer.keys is not None and layer.values is not None
            keys, values = layer.keys[..., :n, :], layer.values[..., :n, :]
            room = KVCache.step
            fresh.keys = mx.concatenate(
                [keys, mx.zeros((*keys.shape[:2], room, keys.shape[3]), keys.dtype)], axis=2)
            fresh.values = mx.concatenate(
                [values, mx.zeros((*values.shape[:2], room, values.shape[3]), values.dtype)], axis=2)
            fresh.offset = n
            out.append(fresh)
        mx.eval([(c.keys, c.values) for c in out])
        return out

    # -- storing -----------------------------------------------------------------

    def insert(self, tokens: Sequence[int], layers: list[KVCache]) -> bool:
        """Keep `layers` (KV of exactly `tokens`); False when it was not kept.

        Unpinned entries that are prefixes of `tokens` go: the new entry serves
        every prefix they served. An entry larger than the whole cap is not kept.
        """
        if self.cap <= 0 or not tokens or not supports(layers):
            return False
        if any(c.offset != len(tokens) for c in layers):
            return False  # a KV that does not encode exactly these tokens would poison reuse
        key = tuple(tokens)
        entry = Entry(key, layers)
        if entry.nbytes > self.cap:
            return False
        old = self._entries.get(key)
        if old is not None:
            if old.pins:
                self._entries.move_to_end(key)
                return False
            self._remove(old)
        for other in [e for e in self._entries.values() if not e.pins]:
            if len(other.tokens) < len(key) and key[:len(other.tokens)] == other.tokens:
                self._remove(other)
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        self.drop_lru(self.cap)
        return key in self._entries

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.tokens]
        self.nbytes -= entry.nbytes
        if entry.pins:
            self._pinned -= entry.nbytes

    # -- dropping ----------------------------------------------------------------

    def set_cap(self, cap: int) -> int:
        """H2: the supervisor's share for this worker; bytes dropped to fit under it."""
        self.cap = max(0, cap)
        return self.drop_lru(self.cap)

    def drop_lru(self, to_bytes: int) -> int:
        """Drop least recently used unpinned entries until at most `to_bytes` remain; bytes dropped."""
        dropped = 0
        for entry in list(self._entries.values()):
            if self.nbytes <= to_bytes:
                break
            if entry.pins:
                continue
            self._remove(entry)
            dropped += entry.nbytes
        return dropped

    def drop_unused(self) -> int:
        """H4: every entry no request relies on; bytes dropped."""
        return self.drop_lru(0)
