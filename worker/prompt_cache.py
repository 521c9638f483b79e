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

Shrink before drop (H6 as proposed): an entry no request relies on may be
quantized in place (mlx-lm's `QuantizedKVCache` layout: packed values, scales
and biases per group of the head dimension), which returns about 70 % (8-bit)
or 85 % (4-bit) of a float32 entry's bytes and keeps the prefix reusable.
`fork()` gives a request float KV dequantized from it, so the engine's other
rooms never see a quantized cache; the values are not the ones the model
computed, so a reply may differ from the one without the cache (H1 holds only
for entries that were never quantized).

Partitions (SPEC H7 as proposed): with API keys, each key's entries are its
own. An entry belongs to the partition of the request that computed it; a
lookup, a prefix that a new entry makes redundant, and every count a reply
carries see only the caller's partition, so `cached_tokens` can never tell one
key whether another key sent a prompt (a shared system prompt included). The
byte cap and the LRU stay one per worker (H2): a partition has no budget of its
own. Without keys every request is in SHARED_PARTITION, as one cache.

The disk tier (H5 as proposed, worker/disk_cache.py) reads an entry into this
cache as any other (`from_disk` marks it until a request forks it, so that
request reports the tokens as read from disk) and writes entries out when the
worker stops (`disk` names the file an unchanged entry already has).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Union

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from shared.protocol import SHARED_PARTITION

Layer = Union[KVCache, QuantizedKVCache]
Key = tuple[str, tuple[int, ...]]  # (partition, tokens): what an entry is found by
QUANT_GROUPS = (64, 32)  # MLX's affine group sizes that divide common head dimensions, largest first


class Entry:
    """One cached token sequence and the per-layer KV that encodes it."""

    __slots__ = ("disk", "from_disk", "layers", "nbytes", "partition", "pins", "tokens")

    def __init__(self, tokens: tuple[int, ...], layers: Sequence[Layer], partition: str = SHARED_PARTITION):
        self.tokens = tokens
        self.partition = partition  # whose requests may reuse it (H7 as proposed)
        self.layers = list(layers)
        self.nbytes = sum(c.nbytes for c in layers)
        self.pins = 0  # requests (running or queued) that will reuse it
        self.disk = ""  # the disk tier's file that holds exactly this entry ("" when none does)
        self.from_disk = False  # read from disk and not yet reused: its first fork says so

    @property
    def key(self) -> Key:
        return self.partition, self.tokens

    @property
    def bits(self) -> int:
        """0 for float KV, else the bits of its quantized values (H6)."""
        first = self.layers[0] if self.layers else None
        return first.bits if isinstance(first, QuantizedKVCache) else 0


class Hit:
    """A lookup result: reuse `tokens` tokens of `entry` (which stays pinned until released)."""

    __slots__ = ("entry", "tokens")

    def __init__(self, entry: Entry, tokens: int):
        self.entry = entry
        self.tokens = tokens


def supports(layers: Sequence) -> bool:
    """Only plain attention KV can be cut at any prefix; others (rotating, SSM) are not cached."""
    return bool(layers) and all(type(c) is KVCache for c in layers)


def storable(layers: Sequence) -> bool:
    """What an entry may hold: every layer plain float KV, or every layer quantized (H6)."""
    kinds = {type(c) for c in layers}
    return bool(layers) and (kinds == {KVCache} or kinds == {QuantizedKVCache})


def quant_group(head_dim: int) -> int:
    """The affine group size for a head dimension; 0 when none divides it (not quantizable)."""
    return next((g for g in QUANT_GROUPS if head_dim % g == 0), 0)


def quantized(layer: KVCache, bits: int) -> QuantizedKVCache | None:
    """`layer`'s tokens (its buffer's padding left out) quantized; None when the head dim does not allow it."""
    assert layer.keys is not None and layer.values is not None  # stored entries are filled
    n = layer.offset
    group = quant_group(layer.keys.shape[-1])
    if not group or layer.values.shape[-1] % group:
        return None
    keys = tuple(mx.quantize(layer.keys[..., :n, :], group_size=group, bits=bits))
    values = tuple(mx.quantize(layer.values[..., :n, :], group_size=group, bits=bits))
    mx.eval(keys, values)
    out = QuantizedKVCache(group_size=group, bits=bits)
    out.state = (keys, values, n, group, bits)
    return out


def _float_prefix(layer: Layer, n: int) -> tuple[mx.array, mx.array]:
    """The first `n` tokens of a layer's keys and values as float arrays (dequantized if need be)."""
    if isinstance(layer, QuantizedKVCache):
        assert layer.keys is not None and layer.values is not None
        kq, vq = ([part[..., :n, :] for part in layer.keys], [part[..., :n, :] for part in layer.values])
        g, b = layer.group_size, layer.bits
        return mx.dequantize(*kq, group_size=g, bits=b), mx.dequantize(*vq, group_size=g, bits=b)
    assert layer.keys is not None and layer.values is not None
    return layer.keys[..., :n, :], layer.values[..., :n, :]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens `a` and `b` (both tuples, or both lists) share at their start. Slices compare in C:
    whole, then 64 at a time,
    then one by one, so a long shared system prompt costs a few comparisons, not one per token
    (the disk tier compares every prompt with each of its entries)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i + 64 <= n and a[i:i + 64] == b[i:i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


common_prefix = _common_prefix


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
        self._entries: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first, all partitions
        self.nbytes = 0
        self._pinned = 0  # bytes of pinned entries, kept as pins change (read at every step)
        self.hits = 0
        self.misses = 0
        self._backing: Callable[[Sequence[int], str], None] | None = None
        self._spill: Callable[[list[Entry]], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pinned_bytes(self) -> int:
        # kept up to date, not summed: the worker reads it with every sample, once a
        # decode step, and a sum over every entry cost a batched step ~4% on a small model
        return self._pinned

    @property
    def releasable(self) -> int:
        """Bytes a shrink may take: entries no running or queued request relies on (H3)."""
        return self.nbytes - self.pinned_bytes

    # -- reuse ---------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int], limit: int, *, partition: str = SHARED_PARTITION) -> Hit | None:
        """The entry of `partition` sharing the longest prefix with `prompt`, at most `limit`
        tokens, pinned. Another partition's entries are never candidates (H7 as proposed).

        `limit` is len(prompt) - 1 for the engine: the last prompt token is
        always run, since its logits give the first output token.
        """
        if self.cap <= 0 or limit <= 0:
            return None
        if self._backing is not None:
            self._backing(prompt, partition)  # H5: the disk tier adds its entry first when it has a longer prefix
        best, best_n = self._best(prompt, limit, partition)
        if best is None or best_n < self.min_reuse:
            self.misses += 1
            return None
        self.hits += 1
        if best.pins == 0:
            self._pinned += best.nbytes
        best.pins += 1
        self._entries.move_to_end(best.key)
        return Hit(best, best_n)

    def _best(self, prompt: Sequence[int], limit: int, partition: str) -> tuple[Entry | None, int]:
        best: Entry | None = None
        best_n = 0
        key = tuple(prompt)  # entries' tokens are tuples: slices compare only with slices of a tuple
        for entry in self._entries.values():
            if entry.partition != partition:
                continue
            n = min(_common_prefix(entry.tokens, key), limit)
            if n > best_n or (n == best_n and best is not None and entry.nbytes < best.nbytes):
                best, best_n = entry, n
        return best, best_n

    def set_spill(self, spill: Callable[[list[Entry]], None] | None) -> None:
        """A slower tier (H5) that `drop_lru` offers the entries it is about to drop."""
        self._spill = spill

    def set_backing(self, fill: Callable[[Sequence[int], str], None] | None) -> None:
        """A slower tier (H5) that `lookup` lets insert the entry a prompt (of a partition) needs
        before it searches."""
        self._backing = fill

    def longest(self, prompt: Sequence[int], limit: int, partition: str) -> int:
        """Tokens `partition`'s best entry would give `prompt` (at most `limit`), nothing pinned or counted."""
        return self._best(prompt, limit, partition)[1] if self.cap > 0 and limit > 0 else 0

    def get(self, tokens: Sequence[int], partition: str) -> Entry | None:
        return self._entries.get((partition, tuple(tokens)))

    def recent_first(self) -> list[Entry]:
        """Every entry, most recently used first (what a stop writes to disk first, H5)."""
        return list(reversed(self._entries.values()))
    def release(self, hit: Hit | None) -> None:
        """The request that pinned `hit` ended or looked again."""
        if hit is not None and hit.entry.pins > 0:
            hit.entry.pins -= 1
            if hit.entry.pins == 0 and self._entries.get(hit.entry.key) is hit.entry:
                self._pinned -= hit.entry.nbytes

    @staticmethod
    def fork(hit: Hit) -> list[KVCache]:
        """Fresh per-layer KV holding the hit's prefix, with room to grow (see module doc)."""
        n = hit.tokens
        out: list[KVCache] = []
        for layer in hit.entry.layers:
            fresh = KVCache()
            keys, values = _float_prefix(layer, n)  # a quantized entry (H6) comes back as float KV
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

    def insert(self, tokens: Sequence[int], layers: Sequence[Layer], *,
               partition: str = SHARED_PARTITION) -> bool:
        """Keep `layers` (KV of exactly `tokens`) for `partition`; False when it was not kept.

        Unpinned entries of the same partition that are prefixes of `tokens` go:
        the new entry serves every prefix they served. Another partition's are
        left alone: dropping them would tell their owner what this one sent (H7
        as proposed). An entry larger than the whole cap is not kept.
        """
        if self.cap <= 0 or not tokens or not storable(layers):
            return False
        if any(c.offset != len(tokens) for c in layers):
            return False  # a KV that does not encode exactly these tokens would poison reuse
        entry = Entry(tuple(tokens), layers, partition)
        if entry.nbytes > self.cap:
            return False
        key, seq = entry.key, entry.tokens
        old = self._entries.get(key)
        if old is not None:
            if old.pins:
                self._entries.move_to_end(key)
                return False
            self._remove(old)
            if not old.bits and not entry.bits:
                entry.disk = old.disk  # the same tokens' float KV (H1): its file still holds this entry
        for other in [e for e in self._entries.values() if not e.pins and e.partition == partition]:
            if len(other.tokens) < len(seq) and seq[:len(other.tokens)] == other.tokens:
                self._remove(other)
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        self.drop_lru(self.cap)
        return key in self._entries

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
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
        victims = self.lru_victims(to_bytes)
        if victims and self._spill is not None:
            self._spill(victims)
        for entry in victims:
            self._remove(entry)
        return sum(entry.nbytes for entry in victims)

    def lru_victims(self, to_bytes: int) -> list[Entry]:
        """The entries `drop_lru(to_bytes)` would drop, least recently used first (H5 writes them first)."""
        victims, held = [], self.nbytes
        for entry in self._entries.values():
            if held <= to_bytes:
                break
            if not entry.pins:
                victims.append(entry)
                held -= entry.nbytes
        return victims

    def drop_unused(self) -> int:
        """H4: every entry no request relies on; bytes dropped."""
        return self.drop_lru(0)

    # -- shrinking before dropping (H6) ------------------------------------------------

    def quantizable(self) -> int:
        """Entries a quantization would shrink: float, no request relying on them."""
        return sum(1 for e in self._entries.values() if not e.pins and not e.bits)

    def quantize_unused(self, bits: int, to_bytes: int = 0) -> tuple[int, int]:
        """Quantize float entries no request relies on, least recently used first, until at most
        `to_bytes` remain; (entries quantized, bytes returned). One entry at a time, each
        evaluated before the next, so the float and quantized copies overlap for one entry only."""
        count = returned = 0
        for entry in list(self._entries.values()):
            if self.nbytes <= to_bytes:
                break
            if entry.pins or entry.bits:
                continue
            layers = [quantized(layer, bits) if isinstance(layer, KVCache) else None for layer in entry.layers]
            if any(layer is None for layer in layers):
                return count, returned  # the model's head dim has no group size: nothing will quantize
            before = entry.nbytes
            entry.layers = [layer for layer in layers if layer is not None]
            entry.nbytes = sum(layer.nbytes for layer in entry.layers)
            # entry.disk stays: a file of these tokens holds the float values, better than these
            self.nbytes -= before - entry.nbytes
            count, returned = count + 1, returned + before - entry.nbytes
        return count, returned
