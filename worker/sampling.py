"""Per-request token samplers built on mlx_lm's sampling pieces.

Why not one global sampler: sequences of different requests interleave in one
process, each with its own temperature, top_p and optionally its own seed. A
seeded request must draw the same tokens whatever else runs beside it, so it
carries its own PRNG key instead of sharing MLX's global random state.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_sampler

Sampler = Callable[[mx.array], mx.array]


def greedy(logits: mx.array) -> mx.array:
    # argmax of logits equals argmax of log-probabilities: skip the logsumexp.
    return mx.argmax(logits, axis=-1)


class SeededSampler:
    """Temperature / top-p sampling from a private key chain (same seed, same tokens)."""

    __slots__ = ("key", "temperature", "top_p")

    def __init__(self, seed: int, temperature: float, top_p: float):
        # OpenAI seeds are int64 and may be negative; MLX keys take uint64 only
        # (a negative one raised TypeError and took the whole worker down).
        self.key = mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, logits: mx.array) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=sub)


def make_request_sampler(temperature: float, top_p: float, seed: int | None) -> Sampler:
    """Greedy at temperature 0; else mlx_lm's sampler, or a seeded one when asked."""
    if temperature == 0:
        return greedy
    if seed is not None:
        return SeededSampler(seed, temperature, top_p)
    chain = make_sampler(temp=temperature, top_p=top_p if 0 < top_p < 1 else 0.0)

    def sample(logits: mx.array) -> mx.array:
        return chain(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return sample
