"""SPEC G1/G2: the prefill cost model follows the real peak of a prefill.

The first model (KV per token plus activations for one chunk) barely followed
the prompt: on a 4 MiB float32 model it said 6.3 MiB for a 3,400-token prompt
in 256-token chunks that peaked at 14.9 MiB (0.43x). The table below holds
figures `scripts/bench_prefill_peak.py` measured; tests/live/test_g_prefill_cost_live.py
runs real MLX prefills through the engine against the same estimate.
"""

from __future__ import annotations

import pytest

from shared.sizes import MiB
from worker import prefill_cost
from worker.prefill_guard import PrefillCost, chunk_bytes, estimate_prefill_peak, kv_bytes, transient_bytes

# (config.json fields, dtype width, tokens, chunk, measured peak in bytes: the larger of
# MLX's peak and the footprint's, above the state before the prefill)
# measured by: python scripts/bench_prefill_peak.py (see README, "The prefill guard")
M4_F32 = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 544,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
M20_F32 = {"hidden_size": 256, "num_hidden_layers": 5, "intermediate_size": 832,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
M20_F16 = {"hidden_size": 320, "num_hidden_layers": 7, "intermediate_size": 928,
           "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 64}
MEASURED = [
    (M4_F32, 4, 256, 256, 3723305),
    (M4_F32, 4, 1024, 256, 6602797),
    (M4_F32, 4, 1024, 1024, 22364160),
    (M4_F32, 4, 1800, 256, 9184304),
    (M4_F32, 4, 1800, 2048, 51390041),
    (M4_F32, 4, 3400, 256, 15945728),
    (M4_F32, 4, 3400, 2048, 62677028),
    (M20_F32, 4, 64, 256, 2390965),
    (M20_F32, 4, 1024, 256, 17481728),
    (M20_F32, 4, 1800, 256, 29491200),
    (M20_F32, 4, 1800, 512, 35307520),
    (M20_F32, 4, 1800, 2048, 102408192),
    (M20_F32, 4, 3400, 256, 52424704),
    (M20_F16, 2, 256, 256, 7418273),
    (M20_F16, 2, 1024, 256, 23597056),
    (M20_F16, 2, 1024, 1024, 41431040),
]


@pytest.mark.parametrize(("config", "width", "tokens", "chunk", "peak"), MEASURED)
def test_g1_estimate_is_at_least_the_measured_peak_and_within_25_percent(config, width, tokens, chunk,
                                                                          peak):
    estimate = estimate_prefill_peak(tokens, prefill_cost.cost_from_config(config, width), chunk)
    assert peak <= estimate <= 1.25 * peak


def test_g1_estimate_follows_the_prompt():
    """The defect: on a 20 MiB float32 model, 1,800 and 3,400 tokens were estimated ~10 MiB
    apart (19.2 and 29.4 MiB) while their prefills in 256-token chunks peaked 22 MiB apart
    (28.1 and 50.0 MiB): the estimate must grow about as fast as the measured peak."""
    cost = prefill_cost.cost_from_config(M20_F32, 4)
    short, long = (estimate_prefill_peak(n, cost, 256) for n in (1800, 3400))
    assert long - short >= 0.9 * (52424704 - 29491200)


def test_g1_cached_prefix_counts_in_the_context_but_not_in_the_kv():
    """A prompt-cache hit's KV is already in the usage, but the new tokens attend to it."""
    cost = prefill_cost.cost_from_config(M4_F32, 4)
    after_prefix = estimate_prefill_peak(256, cost, 256, done=2048)
    assert after_prefix > estimate_prefill_peak(256, cost, 256)
    whole = estimate_prefill_peak(2048 + 256, cost, 256)
    assert after_prefix == pytest.approx(whole - kv_bytes(cost, 2048) * (1 + cost.kv_slack), abs=1)


def test_g1_unknown_architecture_gets_a_cautious_prior():
    cost = prefill_cost.cost_from_config({"model_type": "mystery"}, 2)
    assert cost.kv_per_token == prefill_cost.UNKNOWN_KV
    assert estimate_prefill_peak(1000, cost, 256) >= 1000 * prefill_cost.UNKNOWN_KV


def test_g2_chunk_cost_counts_kv_in_whole_steps():
    """mlx_lm's KVCache grows by 256 tokens: a chunk crossing a step allocates the whole step."""
    cost = PrefillCost(kv_per_token=1000, chunk_per_token=0, kv_step=256)
    assert chunk_bytes(cost, 0, 1) == 256 * 1000
    assert chunk_bytes(cost, 1, 255) == 0
    assert chunk_bytes(cost, 255, 2) == 256 * 1000


def test_g2_learned_scale_never_lowers_the_estimate():
    """A chunk that took less than modelled keeps the prior; never below it (never below the peak)."""
    prior = prefill_cost.cost_from_config(M4_F32, 4)
    learned = prefill_cost.learn(prior, grown=1, tokens=256)
    assert learned.measured and learned.scale == 1.0
    assert estimate_prefill_peak(1000, learned, 256) == estimate_prefill_peak(1000, prior, 256)


def test_g2_learned_scale_covers_a_chunk_the_prior_underestimated():
    """An architecture the prior does not know: the first chunk measured corrects it at once,
    and later, smaller observations lower it only slowly."""
    prior = prefill_cost.cost_from_config(M4_F32, 4)
    grown = 3 * chunk_bytes(prior, 512, 256)
    learned = prefill_cost.learn(prior, grown=grown, tokens=256, done=512)
    assert chunk_bytes(learned, 512, 256) >= grown * 0.999
    calmer = prefill_cost.learn(learned, grown=0, tokens=256, done=768)
    assert 1.0 < calmer.scale < learned.scale
    assert calmer.scale == pytest.approx(0.7 * learned.scale)


def test_g2_short_chunks_teach_nothing():
    prior = prefill_cost.cost_from_config(M4_F32, 4)
    assert prefill_cost.learn(prior, grown=100 * MiB, tokens=prefill_cost.MIN_LEARN_TOKENS - 1) == prior


def test_g2_transient_grows_with_the_context():
    cost = prefill_cost.cost_from_config(M4_F32, 4)
    assert transient_bytes(cost, 3000, 256) > transient_bytes(cost, 0, 256) > 0


@pytest.mark.parametrize("config, expected", [
    ({**M20_F32, "torch_dtype": "float32"}, 2 * 5 * 2 * 64 * 4),                      # GQA: the KV heads count
    ({"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4}, 2 * 3 * 4 * 64 * 2),  # no GQA, no head_dim
    ({"torch_dtype": "float32", "text_config": {**M4_F32, "torch_dtype": "bfloat16"}}, 2 * 2 * 1 * 64 * 2),
])
def test_the_supervisors_kv_per_token_and_the_workers_prior_are_one_formula(tmp_path, config, expected):
    """`load --dry-run` (the supervisor, from config.json) and G1's prior (the worker) cost a
    token of KV the same: both come from shared.modelinfo.AttentionShape."""
    import json

    from shared.modelinfo import dtype_bytes
    from shared.weights import kv_bytes_per_token

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(tmp_path) == expected
    assert prefill_cost.cost_from_config(config, dtype_bytes(config)).kv_per_token == expected
