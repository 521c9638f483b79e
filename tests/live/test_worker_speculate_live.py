"""Speculative decoding with real processes: replies through the front door and a real worker are
token-identical with guessing on and off (n-gram and draft model), `usage` says what was guessed in
OpenAI's words, and `/metrics` and `ps` count it; a model's estimate (A2) holds its draft's weights."""

from __future__ import annotations

import pytest

from shared.weights import estimate_weight_bytes
from supervisor.cli.ps import table
from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config, metric, until

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time " * 6, "def main():\n    return main()\n" * 5, "A worker holds one model.",
           "the cat sat on the mat, the cat sat on"]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    models = [ModelConfig(id="m", path=str(tiny_models.a), pinned=True, max_concurrency=4),
              ModelConfig(id="drafted", path=str(tiny_models.b), max_concurrency=4, draft="small"),
              ModelConfig(id="small", path=str(tiny_models.small))]
    with LiveServer(make_config(models), tmp_path_factory.mktemp("rt")) as live:
        live.run(until(lambda: (w := live.arbiter.pool.worker_for("m")) is not None
                       and w.state in ("ready", "busy"), timeout=60, what="model loaded"))
        yield live


async def _complete(c, model: str, prompt: str, speculative: bool | None, chat: bool = False) -> dict:
    body: dict = {"model": model, "max_tokens": 32, "temperature": 0}
    if speculative is not None:
        body["speculative"] = speculative
    if chat:
        r = await c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": prompt}]})
    else:
        r = await c.post("/v1/completions", json={**body, "prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return {"text": choice["message"]["content"] if chat else choice["text"], "usage": out["usage"]}


@pytest.mark.parametrize("model", ["m", "drafted"])
def test_speculative_replies_are_token_identical_to_plain_ones_and_usage_counts_the_guesses(server, model):
    async def main():
        async with server.client() as c:
            out = []
            for i, prompt in enumerate(PROMPTS):
                chat = i % 2 == 1
                plain = await _complete(c, model, prompt, False, chat)
                guessed = await _complete(c, model, prompt, None, chat)
                out.append((plain, guessed))
            return out, (await c.get("/metrics")).text

    pairs, metrics = server.run(main(), timeout=300)
    accepted = proposed = 0
    for plain, guessed in pairs:
        assert guessed["text"] == plain["text"]
        assert guessed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        assert "completion_tokens_details" not in plain["usage"], "speculative: false guesses nothing"
        details = guessed["usage"].get("completion_tokens_details")
        if details is not None:
            accepted += details["accepted_prediction_tokens"]
            proposed += details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
            assert details["accepted_prediction_tokens"] < guessed["usage"]["completion_tokens"]
    assert accepted > 0 and proposed >= accepted
    assert metric(metrics, "memvisor_speculative_accepted_tokens_total", model=model) >= accepted
    assert metric(metrics, "memvisor_speculative_proposed_tokens_total", model=model) >= proposed
    info = server.arbiter.service.model_info(model)
    assert info.accepted_tokens >= accepted and info.proposed_tokens >= proposed
    assert "GUESSES" in table([info]) and f"{info.accepted_tokens}/{info.proposed_tokens}" in table([info])


def test_a2_the_estimate_of_a_model_with_a_draft_holds_both_weights(server, tiny_models):
    """The draft loads in the model's worker: admission (A2) counts its weights with the model's,
    and the worker's measured usage holds them (it is one process)."""
    async def main():
        async with server.client() as c:
            await _complete(c, "drafted", "hello", None)
        return server.arbiter.service.model_info("drafted"), server.arbiter.service.model_info("m")

    drafted, plain = server.run(main(), timeout=120)
    both = estimate_weight_bytes(tiny_models.b) + estimate_weight_bytes(tiny_models.small)
    assert drafted.estimated_bytes == both
    assert drafted.mlx_active >= both * 0.95
    assert server.arbiter.service.model_info("small").state == "unloaded", "the draft is no model of its own"
