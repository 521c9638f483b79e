"""Batched decode: every decoding sequence of a worker in one forward pass per step.

Why: a decode step of one sequence reads every weight of the model to
produce one token; on a GPU that pass is launch- and bandwidth-bound, so B
sequences in one pass cost little more than one (an H200 went from ~300
tokens/s at batch 1 to ~6,000 at batch 32). On a CPU the pass is
compute-bound and the gain is small, but nothing is lost.

Why rows in place. The first batched decode joined with mlx-lm's `BatchKVCache`:
`extend` concatenates the newcomer onto the running batch and `filter`
gathers the rows that stay, so every join and every leave copied the whole
batch's KV, and for a moment held it twice. On an H200 at 64 streams that
peaked at 87-91 GiB for ~3.5 GB of KV. Here each layer's KV is one buffer
of `capacity` rows by `length` positions, grown and shrunk in steps, and a
row is a slot:

- **join**: the newcomer's prefilled KV is written into a free row, right
  aligned at the shared write position `idx` (left padding masks the rest);
  only the newcomer's tokens are copied.
- **leave**: the last row moves into the hole (one row's tokens copied) so
  the live rows stay `0..n-1` and the forward pass is a slice, not a gather.
- **growth** (a *relayout*, the one copy of the batch): when the rows are
  full (capacity grows by a quarter), when a newcomer is longer than the room
  in front of `idx` (the front grows to its length), or when the positions
  run out (the live window moves to the front of a buffer with a quarter of
  it again as room behind, so a relayout comes at most once per window/4
  steps). Positions are allocated in multiples of `Growth.step` (32).
- **compaction** (a relayout too): when rows leave and the buffers hold more
  than twice what the live rows fit in (free rows, a front no row reaches
  any more), the live rows move into buffers that fit them.

Each layer is copied and evaluated in turn, so a relayout holds at most one
layer twice. So the batch's memory is its buffers (`nbytes`: capacity x
length) and a step allocates only the one token it writes; the live rows'
own tokens are `live_nbytes`, and the worker's memory sample carries both
(and the relayouts) so `status` shows where the batch's memory goes.

Why these steps (measured by scripts/bench_join_memory.py): the
first cut grew rows by half, positions in mlx-lm's 256-token steps with
half the window as room behind, and never shrank before the batch emptied;
its buffers held 3-4x the live KV (and a 256-position step of 64 rows of a
2 GiB model is 1.7 GB). Smaller steps cost more relayouts, each one copy of
the live window, which is small beside the attention's read of that window
at every step.

Why greedy output stays token-identical to one request alone: padding
positions are masked out of attention (their weight is exactly zero), each
row's RoPE offset is its own length, and every other op works row by row.
The attention window is `[start, idx)` with `start` the smallest left
padding, so the empty front costs memory, not compute.
`tests/test_batch.py` checks identity with requests of different lengths
joining and leaving at different steps.

The step keeps the engine's one-ahead pipelining: the next tokens of every
row are queued (`mx.async_eval`) before the current ones are read, in one
`tolist()` for the whole batch. A row under a grammar shares the
pass but not the look-ahead: its mask needs the token just read, so the
engine samples it afterwards from the same logits and `place`s it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import msgspec
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from worker.sampling import Sampler, pick_rows


class Growth(msgspec.Struct, frozen=True):
    """How the buffers grow and shrink: memory held against whole-batch copies (module doc)."""

    step: int = 32          # positions are allocated in multiples of this
    tail: int = 4           # room behind `idx` after a relayout: window // tail (at least one step)
    rows: int = 4           # full rows grow by capacity // rows (at least the rows needed)
    # compact when the buffers hold more than this x what the rows fit in; 0: never, and a
    # relayout for positions keeps its free rows (the first cut)
    shrink_at: float = 2.0


NOW = Growth()
PREVIOUS = Growth(step=256, tail=2, rows=2, shrink_at=0)  # the first cut of rows in place, for the bench


def _round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


class SlotKVCache:
    """One layer's KV for the whole batch: rows `0..n-1` live, positions `[start, idx)` in use.

    The model sees what an mlx-lm cache offers: `update_and_fetch`, a per-row
    `offset` (each row's length, for RoPE) and `make_mask`. Everything that
    changes rows goes through `DecodeBatch`, which keeps every layer in step.
    """

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.n = 0           # live rows
        self.idx = 0         # next write position, shared by every row
        self.start = 0       # smallest left padding: the attention window starts here
        self.offset = mx.array([], mx.int32)        # per row: tokens it holds (its RoPE position)
        self.window_padding = mx.array([], mx.int32)  # per row: left padding inside the window
        self.ragged = False  # some row's padding is inside the window: attention needs the mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the step's tokens at `idx` (`offset` moves in `DecodeBatch.forward`, once for all layers)."""
        assert self.keys is not None and self.values is not None, "the batch has no rows"
        tokens = keys.shape[2]
        end = self.idx + tokens
        assert keys.shape[0] == self.n and end <= self.keys.shape[2], "the batch did not reserve room"
        self.keys[: self.n, :, self.idx:end, :] = keys
        self.values[: self.n, :, self.idx:end, :] = values
        self.idx = end
        return self.keys[: self.n, :, self.start:end, :], self.values[: self.n, :, self.start:end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **_) -> mx.array | None:
        """None when every row starts at the window's start (one row always does): a decode step
        then needs no mask, as with mlx-lm's own cache, and on CUDA an array mask rules out
        both fused attention kernels for a one-token query (MLX 0.32)."""
        if N == 1 and not self.ragged and not return_array and window_size is None:
            return None
        return create_causal_mask(N, offset=self.idx - self.start, window_size=window_size,
                                  left_padding=self.window_padding)

    @property
    def state(self) -> tuple:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class DecodeBatch:
    """The rows of one batched decode: a sequence each, its KV and its token in flight.

    `rows[i]` is any object with a `sample` attribute (the request's sampler);
    `y[i]` is row i's next token: sampled, not yet emitted, not yet fed back.
    Row order is not join order: a leave moves the last row into the hole.
    """

    def __init__(self, greedy: Sampler | None = None, *, max_rows: int = 64, growth: Growth = NOW) -> None:
        self.rows: list = []
        self.layers: list[SlotKVCache] = []
        self.y: mx.array | None = None
        self.pads: list[int] = []  # per row: absolute left padding (first position it holds)
        self.relayouts = 0         # copies of the whole batch so far (growth, compaction)
        self._greedy = greedy      # the sampler that is a plain argmax: all-greedy batches take one op
        self._max_rows = max(1, max_rows)
        self.growth = growth

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, row) -> bool:
        return any(r is row for r in self.rows)

    # -- shape -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows the buffers hold (live or free)."""
        keys = self.layers[0].keys if self.layers else None
        return keys.shape[0] if keys is not None else 0

    @property
    def length(self) -> int:
        """Positions the buffers hold."""
        keys = self.layers[0].keys if self.layers else None
        return keys.shape[2] if keys is not None else 0

    @property
    def idx(self) -> int:
        return self.layers[0].idx if self.layers else 0

    def _sync(self) -> None:
        """Every layer's per-row arrays from `pads` (after a join, a leave or a relayout)."""
        idx = self.idx
        start = min(self.pads) if self.pads else idx
        offset = mx.array([idx - p for p in self.pads], mx.int32)
        window = mx.array([p - start for p in self.pads], mx.int32)
        ragged = any(p != start for p in self.pads)
        for layer in self.layers:
            layer.n, layer.start, layer.ragged = len(self.rows), start, ragged
            layer.offset, layer.window_padding = offset, window

    def _fit(self, window: int, front: int) -> tuple[int, int]:
        """(idx, length) of buffers for a live `window` with `front` positions before idx."""
        step = max(1, self.growth.step)
        new_idx = _round_up(max(window, front), step)
        return new_idx, new_idx + _round_up(window // max(1, self.growth.tail), step)

    def _relayout(self, rows: int, front: int, order: list[int] | None = None) -> None:
        """The one whole-batch copy: new buffers of `rows` rows with `front` positions before `idx`;
        with `order`, only those rows go on, in that order (a compaction)."""
        order = list(range(len(self.rows))) if order is None else order
        n, idx = len(order), self.idx
        pads = [self.pads[i] for i in order]
        start = min(pads) if pads else idx
        window = idx - start
        new_idx, length = self._fit(window, front)
        shift = new_idx - idx
        moved = mx.array(order) if order != list(range(n)) else None
        for layer in self.layers:
            assert layer.keys is not None and layer.values is not None
            for name in ("keys", "values"):
                old = getattr(layer, name)
                fresh = mx.zeros((rows, old.shape[1], length, old.shape[3]), old.dtype)
                if n and window:
                    live = old[:n, :, start:idx, :] if moved is None else old[:, :, start:idx, :][moved]
                    fresh[:n, :, new_idx - window:new_idx, :] = live
                mx.eval(fresh)
                setattr(layer, name, fresh)
                del old
            layer.idx = new_idx
        self.rows = [self.rows[i] for i in order]
        self.pads = [p + shift for p in pads]
        self.relayouts += 1
        self._sync()  # the window's start moved with the rows (a relayout inside forward() too)

    def _reserve(self, rows: int, front: int, tokens: int) -> None:
        """Room for `rows` live rows, `front` positions before `idx` and `tokens` after it."""
        capacity = self.capacity
        if rows <= capacity and front <= self.idx and self.idx + tokens <= self.length:
            return
        if rows > capacity:
            capacity = max(rows, min(self._grown(capacity), self._max_rows))
        elif self.growth.shrink_at > 0:  # a copy for positions: free rows beyond the growth step go too
            capacity = min(capacity, self._grown(rows))
        self._relayout(capacity, front)

    def _grown(self, rows: int) -> int:
        return rows + -(-rows // max(1, self.growth.rows))

    def _oversized(self, kept: list[int]) -> bool:
        """Compaction due: the buffers hold more than `shrink_at` x what rows `kept` fit in."""
        if not kept or self.growth.shrink_at <= 0:
            return False
        window = self.idx - min(self.pads[i] for i in kept)
        _, length = self._fit(window, 0)
        return self.capacity * self.length > self.growth.shrink_at * len(kept) * length

    # -- joining and leaving ---------------------------------------------------------

    def join(self, rows: list, layers: Sequence[Sequence[KVCache]], ys: Sequence[mx.array]) -> None:
        """Add prefilled sequences: per row its per-layer KV and its first (unemitted) token, shape (1,).

        Each newcomer's tokens are written into a free row in place; the running
        rows are not copied (unless the buffers must grow, see module doc).
        """
        if not rows:
            return
        lengths = [per_row[0].offset for per_row in layers]
        if not self.layers:
            self._create(layers[0], len(rows))
        self._reserve(len(self.rows) + len(rows), max(lengths), 1)
        idx = self.idx
        written = []
        for row, per_row, length in zip(rows, layers, lengths):
            slot = len(self.rows)
            for mine, theirs in zip(self.layers, per_row):
                assert mine.keys is not None and mine.values is not None
                assert theirs.keys is not None and theirs.values is not None
                mine.keys[slot:slot + 1, :, idx - length:idx, :] = theirs.keys[..., :length, :]
                mine.values[slot:slot + 1, :, idx - length:idx, :] = theirs.values[..., :length, :]
                written += [mine.keys, mine.values]
            self.rows.append(row)
            self.pads.append(idx - length)
        mx.eval(written)  # the newcomers' own buffers can go now
        y = ys[0] if len(ys) == 1 else mx.concatenate(list(ys))
        self.y = y if self.y is None else mx.concatenate([self.y, y])
        self._sync()

    def _create(self, like: Sequence[KVCache], rows: int) -> None:
        """Empty layers shaped like a newcomer's KV (dtype, heads, head sizes), no positions yet."""
        self.layers = []
        for theirs in like:
            assert theirs.keys is not None and theirs.values is not None
            layer = SlotKVCache()
            keys, values = theirs.keys, theirs.values
            layer.keys = mx.zeros((rows, keys.shape[1], 0, keys.shape[3]), keys.dtype)
            layer.values = mx.zeros((rows, values.shape[1], 0, values.shape[3]), values.dtype)
            self.layers.append(layer)

    def keep(self, indices: list[int], y: mx.array | None) -> None:
        """Only rows `indices` go on, with `y` (one token per current row) as their next tokens.

        Rows that stay beyond the new count move into the holes, one row's
        positions `[its padding, idx)` each; nothing else is copied.
        """
        n = len(indices)
        if n == len(self.rows):
            self.y = y
            return
        if not indices:
            self.clear()
            return
        if self._oversized(indices):
            self._relayout(n, 0, indices)
            self.y = y[mx.array(indices)] if y is not None else None
            self._sync()
            return
        kept = set(indices)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in indices if i >= n]
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            self._move(mover, hole)
            order[hole] = mover
        self.rows = [self.rows[i] for i in order]
        self.pads = [self.pads[i] for i in order]
        self.y = y[mx.array(order)] if y is not None else None
        self._sync()

    def _move(self, source: int, target: int) -> None:
        """Row `source`'s positions into row `target`, in place.

        The copy is evaluated before it is written: a slice of the buffer that
        is still alive when the write runs would make MLX copy the whole buffer.
        """
        pad, idx = self.pads[source], self.idx
        for layer in self.layers:
            for name in ("keys", "values"):
                buffer = getattr(layer, name)
                row = mx.contiguous(buffer[source:source + 1, :, pad:idx, :])
                mx.eval(row)
                buffer[target:target + 1, :, pad:idx, :] = row
            mx.eval(layer.keys, layer.values)

    def remove(self, row) -> bool:
        """Drop one row between steps (abort); False when it is not in the batch."""
        for i, r in enumerate(self.rows):
            if r is row:
                self.keep([j for j in range(len(self.rows)) if j != i], self.y)
                return True
        return False

    def clear(self) -> None:
        """No rows: the buffers go too (their memory returns with the pool)."""
        self.rows, self.layers, self.y, self.pads = [], [], None, []

    def extract(self, indices: list[int]) -> list[list[KVCache]]:
        """Rows `indices`' KV as plain per-layer caches (copies, evaluated together), e.g. for the
        prompt cache."""
        idx = self.idx
        out = []
        for index in indices:
            pad = self.pads[index]
            row = []
            for layer in self.layers:
                assert layer.keys is not None and layer.values is not None
                cache = KVCache()
                cache.keys = mx.contiguous(layer.keys[index:index + 1, :, pad:idx, :])
                cache.values = mx.contiguous(layer.values[index:index + 1, :, pad:idx, :])
                cache.offset = idx - pad
                row.append(cache)
            out.append(row)
        mx.eval([(c.keys, c.values) for row in out for c in row])  # no slice of the buffers stays alive (see _move)
        return out

    # -- the step --------------------------------------------------------------------

    def forward(self, model) -> tuple[mx.array, mx.array]:
        """Feed every row's token: the logits and the sampled successors (lazy, already queued).

        Greedy rows share one argmax over the batch; rows with their own samplers
        are picked in as few calls as their settings allow (worker/sampling.py
        `pick_rows`: one per kind of plain settings, one per row with penalties,
        a bias, logprobs or a seed) and overwrite their places. A row with
        `constraint` set is left to `place` (its mask needs the token this step reads).
        """
        self._reserve(len(self.rows), 0, 1)
        logits = model(self._in_flight()[:, None], cache=self.layers)[:, -1, :]
        offset = self.layers[0].offset + 1  # every layer's rows moved one position: one op, not one per layer
        for layer in self.layers:
            layer.offset = offset
        following = mx.argmax(logits, axis=-1)
        own = [(i, row.sample) for i, row in enumerate(self.rows)
               if row.sample is not self._greedy and getattr(row, "constraint", None) is None]
        if own:
            following = self.place(following, pick_rows(own, logits))
        mx.async_eval(following)
        return logits, following

    def verify(self, model, tokens: list[int]) -> mx.array:
        """The only row's `tokens` (its token in flight, then guesses) through the model in one
        pass: their logits (len(tokens), vocab), lazy; every position stays in the KV until
        `rewind` takes the rejected ones back (worker/speculate.py)."""
        assert len(self.rows) == 1, "a checked step runs on a batch of one row"
        self._reserve(1, 0, len(tokens))
        logits = model(mx.array([tokens], mx.uint32), cache=self.layers)[0]
        offset = self.layers[0].offset + len(tokens)
        for layer in self.layers:
            layer.offset = offset
        return logits

    def rewind(self, positions: int) -> None:
        """Take the last `positions` written positions back out of every row's KV."""
        if positions <= 0:
            return
        for layer in self.layers:
            layer.idx -= positions
        self._sync()

    def _in_flight(self) -> mx.array:
        """`y`, which a batch with rows always has (None only while it is empty)."""
        assert self.y is not None, "the batch has no rows"
        return self.y

    def tokens(self) -> list[int]:
        """Every row's token in flight as ints, in one read (it waits for the step that sampled them)."""
        # y is 1-D of integer ids, so tolist() is a list of ints (MLX types it as any nesting)
        return cast(list[int], self._in_flight().tolist())

    @staticmethod
    def place(following: mx.array, drawn: list[tuple[list[int], mx.array]]) -> mx.array:
        """`following` with the tokens of rows `rows` replaced by `tokens`, for each (rows, tokens)."""
        out = mx.array(following)
        rows = [i for indices, _ in drawn for i in indices]
        tokens = drawn[0][1] if len(drawn) == 1 else mx.concatenate([t for _, t in drawn])
        out[mx.array(rows)] = tokens.astype(out.dtype)
        return out

    @property
    def nbytes(self) -> int:
        """What the buffers hold, live rows or not (capacity x length): the batch's real memory."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def live_nbytes(self) -> int:
        """What the live rows' own tokens take: each row's positions `[its padding, idx)`.

        The rest of `nbytes` is room: free rows, positions behind `idx` not yet
        written, the front no row reaches, and each row's left padding.
        """
        capacity, length = self.capacity, self.length
        if not capacity or not length:
            return 0
        per_position = self.nbytes // (capacity * length)
        return per_position * sum(self.idx - pad for pad in self.pads)
