"""A quantized model served by a real supervisor and worker (tests/test_quantized.py holds
how it is written, sized and costed)."""

from __future__ import annotations

import pytest

from shared.sizes import MiB
from shared.weights import estimate_weight_bytes

pytestmark = pytest.mark.slow


def test_quantized_model_serves_token_identical_to_mlx_lm_and_status_matches_estimate(quantized, tmp_path):
    """Through a real supervisor and worker: greedy output equals mlx_lm in-process; the worker's
    reported weights are the A2 estimate and its measured MLX bytes cover them."""
    import mlx_lm

    from supervisor.config import ModelConfig
    from tests.http_harness import LiveServer, make_config, until

    path = quantized[4]
    model, tokenizer = mlx_lm.load(str(path))
    expected = mlx_lm.generate(model, tokenizer, "Once upon a time", max_tokens=8)
    with LiveServer(make_config([ModelConfig(id="q4", path=str(path))]), tmp_path / "rt") as live:
        async def main():
            completion = await live.openai().completions.create(model="q4", prompt="Once upon a time",
                                                                 max_tokens=8, temperature=0)
            handle = live.arbiter.pool.worker_for("q4")
            await until(lambda: handle.sample is not None or not handle.live, timeout=60, what="a sample")
            return completion, handle

        completion, handle = live.run(main())
    estimate = estimate_weight_bytes(path)
    assert completion.choices[0].text == expected
    assert handle.weight_bytes == estimate
    assert estimate <= handle.sample.memory.mlx_active <= estimate * 1.5 + 4 * MiB
