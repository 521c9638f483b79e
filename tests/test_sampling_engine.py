"""The sampling options in the engine, on a real tiny model, alone and batched.

The tiny model's greedy reply to PROMPT repeats one token, which makes the
penalties' effect countable. Every batched test compares each row with the
same request alone: per-row settings must not leak across rows, greedy rows
stay token-identical, and a seeded row draws the same tokens.
"""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import msgspec
import pytest

from shared.protocol import Failed, Generate, TokenOut
from tests.engine_harness import Run, drive
from worker.engine import Engine
from worker.sampling import Settings

PROMPT = "Once upon a time"
N = 24


@pytest.fixture(scope="module", params=["batched", "single"])
def engine(request, loaded):
    model, tokenizer = loaded
    return Engine(model, tokenizer, own_usage_fn=lambda: 0, batch_decode=request.param == "batched")


def _prompt(engine: Engine) -> list[int]:
    return engine.encode_prompt(PROMPT)


def _alone(engine: Engine, settings: Settings, max_tokens: int = N, prompt: list[int] | None = None) -> Run:
    engine.submit("alone", prompt or _prompt(engine), max_tokens, sampling=settings)
    return drive(engine)


def _together(engine: Engine, rows: dict[str, Settings], max_tokens: int = N) -> Run:
    for rid, settings in rows.items():
        engine.submit(rid, _prompt(engine), max_tokens, sampling=settings)
    return drive(engine)


def _repeats(tokens: list[int]) -> int:
    return sum(n - 1 for n in Counter(tokens).values())


def _logprobs(run: Run, rid: str) -> list:
    return [ev.logprobs for ev in run.by_id[rid] if isinstance(ev, TokenOut) and ev.token_id >= 0]


def test_top_k_1_equals_greedy_at_any_temperature(engine):
    greedy = _alone(engine, Settings()).tokens("alone")
    run = _together(engine, {"hot": Settings(temperature=1.5, top_k=1), "warm": Settings(temperature=0.7, top_k=1, seed=3),
                             "greedy": Settings(), "noise": Settings(temperature=1.5)})
    assert run.tokens("hot") == run.tokens("warm") == run.tokens("greedy") == greedy
    assert run.tokens("noise") != greedy  # the control: the same temperature without top_k leaves it


def test_a_large_logit_bias_forces_its_token_and_minus_100_bans_it(engine):
    greedy = _alone(engine, Settings()).tokens("alone")
    forced = next(t for t in range(100, 4000) if t not in greedy)
    run = _together(engine, {"forced": Settings(logit_bias={forced: 100.0}),
                             "forced_hot": Settings(temperature=1.0, seed=1, logit_bias={forced: 100.0}),
                             "banned": Settings(logit_bias={t: -100.0 for t in set(greedy)}),
                             "greedy": Settings()})
    assert run.tokens("forced") == run.tokens("forced_hot") == [forced] * N
    assert not set(run.tokens("banned")) & set(greedy) and len(run.tokens("banned")) == N
    assert run.tokens("greedy") == greedy  # the other rows' biases did not reach it


def test_the_penalties_change_what_repeats(engine):
    greedy = _alone(engine, Settings()).tokens("alone")
    assert _repeats(greedy) >= N // 2, "the control: this model's greedy reply repeats itself"
    rows = {"repetition": Settings(repetition_penalty=2.0, repetition_context_size=64),
            "presence": Settings(presence_penalty=2.0, presence_context_size=64),
            "frequency": Settings(frequency_penalty=1.0, frequency_context_size=64),
            "short": Settings(presence_penalty=2.0, presence_context_size=1)}
    run = _together(engine, {**rows, "greedy": Settings()})
    for rid in rows:
        assert _repeats(run.tokens(rid)) < _repeats(greedy), rid
        assert run.tokens(rid) == _alone(engine, rows[rid]).tokens("alone"), rid  # batched as alone
    assert _repeats(run.tokens("presence")) == 0  # each token at most once in a 64-token look-back
    # a look-back of one token only stops immediate repeats
    short = run.tokens("short")
    assert all(a != b for a, b in zip(short, short[1:]))
    assert run.tokens("greedy") == greedy


def test_min_p_keeps_only_tokens_near_the_top(engine):
    """Against the reported logprobs (taken before the filters): a sampled token's probability is
    at least min_p times the most likely one's (to float16's rounding: mlx_lm filters the model's
    float16 logprobs, the report is float32)."""
    floor = math.log(0.3) - 0.01
    hot = Settings(temperature=3.0, seed=5, logprobs=True, top_logprobs=1)
    run = _together(engine, {"min_p": msgspec.structs.replace(hot, min_p=0.3), "free": hot})
    kept = [lp.logprob - lp.top[0].logprob for lp in _logprobs(run, "min_p")]
    assert len(kept) == N and all(gap >= floor for gap in kept), min(kept)
    assert any(lp.logprob - lp.top[0].logprob < floor for lp in _logprobs(run, "free")), "the control"


def test_logprobs_are_well_formed_and_match_the_models_own_distribution(engine, loaded):
    model, tokenizer = loaded
    run = _together(engine, {"lp": Settings(logprobs=True, top_logprobs=5), "plain": Settings()})
    tokens, items = run.tokens("lp"), _logprobs(run, "lp")
    assert tokens == run.tokens("plain") and len(items) == N
    assert all(lp is msgspec.UNSET for lp in _logprobs(run, "plain"))  # only the row that asked
    # the reference: one forward pass over prompt + reply, log-softmax at each position
    prompt = _prompt(engine)
    logits = model(mx.array(prompt + tokens[:-1])[None])[0, len(prompt) - 1:].astype(mx.float32)
    reference = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    for token, item, row in zip(tokens, items, reference):
        assert item.token == tokenizer.decode([token])
        assert item.logprob <= 0 and math.isclose(item.logprob, row[token], abs_tol=0.05)
        values = [t.logprob for t in item.top]
        assert len(item.top) == 5 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert item.top[0].token == item.token and item.top[0].logprob == item.logprob  # greedy took the top


def test_per_row_settings_stay_in_their_row_and_a_seeded_row_repeats(engine):
    rows = {"greedy": Settings(), "greedy_lp": Settings(logprobs=True, top_logprobs=2),
            "forced": Settings(logit_bias={777: 100.0}), "penalised": Settings(repetition_penalty=2.0),
            "seeded": Settings(temperature=1.0, top_k=20, min_p=0.02, seed=9, frequency_penalty=0.5),
            "noise": Settings(temperature=1.5)}
    alone = {rid: _alone(engine, settings).tokens("alone") for rid, settings in rows.items() if rid != "noise"}
    run = _together(engine, rows)
    for rid, tokens in alone.items():
        assert run.tokens(rid) == tokens, rid
    assert run.tokens("greedy_lp") == run.tokens("greedy")


def test_a_bias_on_a_token_past_the_vocabulary_fails_that_request_alone(engine):
    engine.submit_generate(Generate(request_id="bad", prompt=PROMPT, max_tokens=4, logit_bias={10**6: 5.0}))
    engine.submit_generate(Generate(request_id="good", prompt=PROMPT, max_tokens=4))
    run = drive(engine)
    bad = run.terminal("bad")
    assert isinstance(bad, Failed) and bad.code == "invalid_request" and "logit_bias" in bad.message
    assert len(run.tokens("good")) == 4


def test_generate_carries_every_setting_to_the_request(engine):
    """The wire's field names are the sampler's: a Generate's settings reach the picker whole."""
    engine.submit_generate(Generate(request_id="g", prompt=PROMPT, max_tokens=N, top_k=1, temperature=1.5,
                                    logprobs=True, top_logprobs=3))
    run = drive(engine)
    assert run.tokens("g") == _alone(engine, Settings()).tokens("alone")
    assert all(len(lp.top) == 3 for lp in _logprobs(run, "g"))


def test_rows_with_the_same_plain_settings_are_picked_together_each_from_its_own_row(engine, monkeypatch):
    """Rows whose pickers choose alike (temperature, top_p, min_p, top_k; no penalty, bias,
    logprobs or seed) take one pick for all of them (worker/sampling.py pick_rows), not a call
    each per step; each row's token still comes from its own row: with top_k=1 every row is
    its own greedy reply, at two temperatures (two picks). A seeded row keeps its own call."""
    from worker.sampling import TokenPicker

    greedy = _alone(engine, Settings()).tokens("alone")
    calls: Counter = Counter()
    own_call = TokenPicker.__call__

    def counted(self, logits):
        calls["seeded" if self.key is not None else "plain"] += 1
        return own_call(self, logits)

    monkeypatch.setattr(TokenPicker, "__call__", counted)
    rows = {f"hot{i}": Settings(temperature=1.5, top_k=1) for i in range(3)}
    rows |= {f"warm{i}": Settings(temperature=0.7, top_k=1) for i in range(3)}
    rows["seeded"] = Settings(temperature=0.9, top_k=1, seed=5)
    run = _together(engine, rows)
    assert all(run.tokens(rid) == greedy for rid in rows)
    if engine.batch_decode:
        assert calls["plain"] == 0 and calls["seeded"] == N
