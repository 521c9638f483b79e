"""SPEC G1: the prefill cost model's prior against real MLX prefills through the engine, in
this process (2-4 s a prefill on the 2-core machines, so slow; the measured table is in
tests/test_g_prefill_cost.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shared.limits import Limits
from worker import own_memory
from worker.engine import Engine
from worker.prefill_guard import estimate_prefill_peak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("tokens", "chunk"), [(300, 256), (1000, 256), (700, 512)])
def test_g1_prior_covers_a_real_engine_prefill_within_25_percent(loaded, monkeypatch, tokens,
                                                                  chunk):
    """The engine's own prefill (the session's 2 MiB float16 model, chunks of `chunk`, guard
    off, no time cap) peaks at or under
    G1's estimate from the prior, and not 25 % under it. The engine restarts MLX's peak counter
    before each chunk (to learn that chunk's cost); here it must span the whole prefill."""
    model, tokenizer = loaded
    engine = Engine(model, tokenizer, max_chunk=chunk, chunk_seconds=0, own_usage_fn=lambda: 0)
    vocab = model.args.vocab_size
    limits = Limits(max_concurrency=1)

    def run(request_id: str, n: int) -> None:
        engine.submit(request_id, [(i * 7919) % (vocab - 8) + 5 for i in range(n)], max_tokens=1)
        for _ in range(1000):
            if not engine.has_work:
                return
            engine.step(limits, lambda: 0)
        raise AssertionError("engine still busy")

    run("warm-up", 32)  # first-call buffers are nobody's prefill
    monkeypatch.setattr(own_memory, "reset_peak", lambda: None)
    estimate = estimate_prefill_peak(tokens, engine.cost, chunk)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    run("r", tokens)
    peak = mx.get_peak_memory() - before
    assert peak <= estimate <= 1.25 * peak, (peak, estimate)
