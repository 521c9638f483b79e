"""Batched decode (issue 11): every decoding sequence of a worker in one forward pass per step.

Why: a decode step of one sequence reads every weight of the model to
produce one token; on a GPU that pass is launch- and bandwidth-bound, so B
sequences in one pass cost little more than one (an H200 went from ~300
tokens/s at batch 1 to ~6,000 at batch 32). On a CPU the pass is
compute-bound and the gain is small, but nothing is lost.

How sequences get in and out. Each request is prefilled alone, in its own
per-layer `KVCache` (which may be a fork of a prompt-cache entry, H1), so
the prefill guard (G1-G3) still sizes and checks one request's chunks. When
its first token is sampled it *joins*: its KV is left-padded into mlx-lm's
`BatchKVCache` (`merge`, then `extend` onto the running batch). A sequence
that ends *leaves* between steps: its rows are cut out (`filter`), and its KV
can first be copied out (`extract`) for the prompt cache. Aborts and reclaims
are obeyed at step boundaries, where the batch is consistent.

Why greedy output stays token-identical to one request alone: padding
positions are masked out of attention (their weight is exactly zero), each
row's RoPE offset is its own length, and every other op works row by row.
`tests/test_batch.py` checks identity with requests of different lengths
joining at different steps.

The step keeps the engine's one-ahead pipelining: the next tokens of every
row are queued (`mx.async_eval`) before the current ones are read, in one
`tolist()` for the whole batch. A row under a grammar (issue 13) shares the
pass but not the look-ahead: its mask needs the token just read, so the
engine samples it afterwards from the same logits and `place`s it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

Sampler = Callable[[mx.array], mx.array]


class DecodeBatch:
    """The rows of one batched decode: a sequence each, its KV and its token in flight.

    `rows[i]` is any object with a `sample` attribute (the request's sampler);
    `y[i]` is row i's next token: sampled, not yet emitted, not yet fed back.
    """

    def __init__(self, greedy: Sampler | None = None) -> None:
        self.rows: list = []
        self.layers: list[BatchKVCache] = []
        self.y: mx.array | None = None
        self._greedy = greedy  # the sampler that is a plain argmax: all-greedy batches take one op

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, row) -> bool:
        return any(r is row for r in self.rows)

    def join(self, rows: list, layers: Sequence[Sequence[KVCache]], ys: Sequence[mx.array]) -> None:
        """Add prefilled sequences: per row its per-layer KV and its first (unemitted) token, shape (1,).

        The newcomers are merged among themselves first, so the running batch's
        KV is copied once per step however many join (`extend` copies it).
        """
        if not rows:
            return
        incoming = [BatchKVCache.merge([per_row[i] for per_row in layers]) for i in range(len(layers[0]))]
        y = ys[0] if len(ys) == 1 else mx.concatenate(list(ys))
        if not self.rows:
            self.layers, self.y = incoming, y
        else:
            for mine, theirs in zip(self.layers, incoming):
                mine.extend(theirs)
            self.y = mx.concatenate([self._in_flight(), y])
        self.rows.extend(rows)

    def forward(self, model) -> tuple[mx.array, mx.array]:
        """Feed every row's token: the logits and the sampled successors (lazy, already queued).

        Greedy rows share one argmax over the batch; a row with its own sampler
        (temperature, top_p, seed) samples from its own logits and overwrites its
        place. A row with `constraint` set is left to `place` (its mask needs
        the token this step reads).
        """
        logits = model(self._in_flight()[:, None], cache=self.layers)[:, -1, :]
        following = mx.argmax(logits, axis=-1)
        own = [(i, row.sample(logits[i:i + 1])) for i, row in enumerate(self.rows)
               if row.sample is not self._greedy and getattr(row, "constraint", None) is None]
        if own:
            following = self.place(following, own)
        mx.async_eval(following)
        return logits, following

    def _in_flight(self) -> mx.array:
        """`y`, which a batch with rows always has (None only while it is empty)."""
        assert self.y is not None, "the batch has no rows"
        return self.y

    def tokens(self) -> list[int]:
        """Every row's token in flight as ints, in one read (it waits for the step that sampled them)."""
        # y is 1-D of integer ids, so tolist() is a list of ints (MLX types it as any nesting)
        return cast(list[int], self._in_flight().tolist())

    @staticmethod
    def place(following: mx.array, drawn: list[tuple[int, mx.array]]) -> mx.array:
        """`following` with row i's token replaced by each (i, token of shape (1,)) in `drawn`."""
        out = mx.array(following)
        out[mx.array([i for i, _ in drawn])] = mx.concatenate([t for _, t in drawn]).astype(out.dtype)
        return out

    def extract(self, index: int) -> list[KVCache]:
        """Row `index`'s KV as plain per-layer caches (a copy), e.g. for the prompt cache."""
        return [layer.extract(index) for layer in self.layers]

    def keep(self, indices: list[int], y: mx.array | None) -> None:
        """Only rows `indices` go on, with `y` (one token per current row) as their next tokens."""
        if len(indices) == len(self.rows):
            self.y = y
            return
        if not indices:
            self.clear()
            return
        picked = mx.array(indices)
        for layer in self.layers:
            layer.filter(picked)
        self.y = y[picked] if y is not None else None
        self.rows = [self.rows[i] for i in indices]

    def remove(self, row) -> bool:
        """Drop one row between steps (abort); False when it is not in the batch."""
        for i, r in enumerate(self.rows):
            if r is row:
                self.keep([j for j in range(len(self.rows)) if j != i], self.y)
                return True
        return False

    def clear(self) -> None:
        self.rows, self.layers, self.y = [], [], None

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
