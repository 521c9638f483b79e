"""C12/H2 as revised 2026-12-01, through a real supervisor, real workers and real HTTP.

With the default `hot_cache_max` (1 GiB) and a custom ceiling of a
few hundred MiB, C12's old reservation (cache used + 512 MiB) took every
worker's limits down to almost nothing, and the front door's first check --
models loaded on demand under a small custom ceiling, a `hi` prompt with
max_tokens 8 to a second model -- was refused with "prompt needs about ...
but the limit is ...". It was first seen with three 300 MiB models under
1 GiB; here three 64 MiB models under 600 MiB make the same squeeze (the old
limit would be 88 MiB), small enough for CPU MLX and clear of the prefill
estimate another change is fixing.
"""

from __future__ import annotations

import pytest

from shared.sizes import MiB
from supervisor.config import GuardConfig, ModelConfig
from tests.http_harness import LiveServer, make_config

pytestmark = pytest.mark.slow

CEILING = 600 * MiB


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    from modelfiles.modelgen import make_model

    root = tmp_path_factory.mktemp("budget-models")
    paths = []
    for seed in range(3):
        make_model(root / f"m{seed}", 64 * MiB, seed)
        paths.append(root / f"m{seed}")
    return paths


def test_c12_default_budget_under_a_small_custom_ceiling_serves_a_second_model(three_models, tmp_path):
    models = [ModelConfig(id=f"m{i}", path=str(path)) for i, path in enumerate(three_models)]
    guard = GuardConfig(tier="custom", custom_ceiling=CEILING)  # hot_cache_max: the default 1 GiB
    assert guard.hot_cache_max == 1024 * MiB
    config = make_config(models, guard=guard)
    with LiveServer(config, tmp_path / "rt") as live:

        async def main():
            async with live.client() as c:
                answers = []
                for model in ("m0", "m1"):
                    r = await c.post("/v1/chat/completions", json={
                        "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
                    answers.append((model, r.status_code, r.text[:300]))
                status = (await c.get("/status")).json()["guard"]
                return answers, status

        answers, status = live.run(main())
    assert [a[1] for a in answers] == [200, 200], answers
    assert status["hot_cache_budget"] == status["soft_bytes"] // 4  # H2: a quarter of soft, not 1 GiB
    assert status["hot_cache_reserved"] == status["hot_cache_used"]  # C12: what the caches hold
    assert status["worker_ceiling"] == status["ceiling"] - status["hot_cache_used"]
