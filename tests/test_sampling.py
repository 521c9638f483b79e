"""Each sampling option's effect, on the worker's per-request token picker.

Logits here are made up so each option's effect is certain (which token wins
by how much); tests/test_sampling_engine.py checks the same options on a real
model, batched, and tests/live/test_sampling_live.py through the APIs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from worker.sampling import MAX_TOP_LOGPROBS, Settings, TokenPicker, check, greedy, make_request_sampler

VOCAB = 64


def _logits(seed: int = 0) -> mx.array:
    return mx.random.normal((1, VOCAB), key=mx.random.key(seed)) * 3


def _draw(picker, logits: mx.array, n: int) -> list[int]:
    return [picker(logits).item() for _ in range(n)]


def _best(logits: mx.array) -> int:
    return int(mx.argmax(logits, axis=-1).item())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("seed", [None, 11])
def test_top_k_1_picks_the_greedy_token_at_any_temperature(temperature, seed):
    for case in range(4):
        logits = _logits(case)
        picker = make_request_sampler(Settings(temperature=temperature, top_k=1, seed=seed))
        assert _draw(picker, logits, 8) == [_best(logits)] * 8


TINY = [1e-5, 1e-30, 1e-38, 1e-40, 1e-300, 5e-324]


@pytest.mark.parametrize("temperature", TINY)
def test_a_temperature_at_or_below_the_floor_is_greedy_whatever_the_seed(temperature):
    """1e-40 and 1e-300 overflowed float32 (1/T = inf) and drew uniformly: the reply changed
    with the seed. Every such picker, plain or with logprobs and a penalty (its own call),
    is argmax, as temperature 0 is (worker/sampling.py GREEDY_AT_OR_BELOW)."""
    from shared.protocol import Generate

    assert Settings.of(Generate(request_id="r", prompt="x", temperature=temperature)).temperature == 0.0
    for case in range(3):
        logits = _logits(case)
        for seed in (None, 1, 2, 3):
            for extra in ({}, {"logprobs": True, "presence_penalty": 0.1}):
                picker = make_request_sampler(Settings(temperature=temperature, seed=seed, **extra))
                assert _draw(picker, logits, 6) == [_best(logits)] * 6, (temperature, seed, extra)


def test_without_top_k_a_hot_sampler_leaves_the_greedy_token():
    """The control of the test above: at these temperatures other tokens do come."""
    logits = _logits(0)
    drawn = _draw(make_request_sampler(Settings(temperature=2.0, seed=5)), logits, 40)
    assert set(drawn) != {_best(logits)}


def test_top_k_samples_only_among_the_k_most_likely():
    logits = _logits(1)
    top3 = set(mx.argsort(-logits[0])[:3].tolist())
    drawn = _draw(make_request_sampler(Settings(temperature=5.0, top_k=3, seed=2)), logits, 60)
    assert set(drawn) <= top3 and len(set(drawn)) > 1


def test_top_k_past_the_vocabulary_keeps_every_token():
    """mlx_lm's apply_top_k raises for k >= vocab; the picker leaves the logits alone instead."""
    logits = _logits(2)
    assert _draw(make_request_sampler(Settings(temperature=1.0, top_k=VOCAB, seed=3)), logits, 5) == \
        _draw(make_request_sampler(Settings(temperature=1.0, seed=3)), logits, 5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_large_positive_logit_bias_forces_its_token(temperature):
    logits = _logits(3)
    forced = (_best(logits) + 7) % VOCAB
    picker = make_request_sampler(Settings(temperature=temperature, logit_bias={forced: 100.0}, seed=1))
    assert _draw(picker, logits, 10) == [forced] * 10


def test_a_logit_bias_of_minus_100_bans_the_token():
    logits = mx.zeros((1, VOCAB))
    logits[0, 9] = 8.0  # by far the most likely
    assert _draw(make_request_sampler(Settings(temperature=0.0)), logits, 1) == [9]
    banned = make_request_sampler(Settings(temperature=1.0, logit_bias={9: -100.0}, seed=4))
    assert 9 not in _draw(banned, logits, 50)


def test_repetition_penalty_turns_away_from_a_token_in_its_look_back():
    logits = mx.zeros((1, VOCAB))
    logits[0, 5], logits[0, 6] = 4.0, 3.0
    assert make_request_sampler(Settings(repetition_penalty=1.0), prompt=[5])(logits).item() == 5
    assert make_request_sampler(Settings(repetition_penalty=1.5), prompt=[5])(logits).item() == 6  # 4/1.5 < 3
    # outside the look-back the token is not penalised
    far = [5] + [1] * 4
    assert make_request_sampler(Settings(repetition_penalty=1.5, repetition_context_size=4), prompt=far)(
        logits).item() == 5
    assert make_request_sampler(Settings(repetition_penalty=1.5, repetition_context_size=5), prompt=far)(
        logits).item() == 6


def test_frequency_penalty_counts_each_occurrence_presence_penalty_counts_one():
    """Token 5 leads by 1.0 and came twice: 0.6 once (presence) leaves it first, 0.6 twice
    (frequency) puts it behind."""
    logits = mx.zeros((1, VOCAB))
    logits[0, 5], logits[0, 6] = 4.0, 3.0
    prompt = [5, 2, 5]
    assert make_request_sampler(Settings(presence_penalty=0.6), prompt=prompt)(logits).item() == 5
    assert make_request_sampler(Settings(frequency_penalty=0.6), prompt=prompt)(logits).item() == 6
    assert make_request_sampler(Settings(presence_penalty=1.2), prompt=prompt)(logits).item() == 6
    assert make_request_sampler(Settings(frequency_penalty=-1.5), prompt=[6])(logits).item() == 6  # negative: favoured


def test_the_penalties_look_back_on_the_tokens_the_picker_chose():
    """Greedy on fixed logits repeats one token forever; with a repetition penalty over the
    tokens it chose, it cannot pick the same token twice in a row."""
    logits = mx.zeros((1, VOCAB))
    logits[0, 5], logits[0, 6], logits[0, 7] = 4.0, 3.9, 3.8
    assert _draw(make_request_sampler(Settings()), logits, 6) == [5] * 6
    drawn = _draw(make_request_sampler(Settings(repetition_penalty=2.0, repetition_context_size=1)), logits, 6)
    assert drawn == [5, 6, 5, 6, 5, 6]
    drawn = _draw(make_request_sampler(Settings(presence_penalty=1.0, presence_context_size=2)), logits, 6)
    assert drawn == [5, 6, 7, 5, 6, 7]


def test_min_p_excludes_tokens_below_its_share_of_the_top_probability():
    logits = mx.full((1, VOCAB), -2.0)
    logits[0, :4] = mx.array([3.0, 2.9, 2.8, 2.7])  # the rest: each under 1% of the top's probability
    wide = set(_draw(make_request_sampler(Settings(temperature=3.0, seed=8)), logits, 200))
    narrow = set(_draw(make_request_sampler(Settings(temperature=3.0, min_p=0.5, seed=8)), logits, 200))
    assert narrow <= {0, 1, 2, 3} and len(narrow) > 1
    assert wide - {0, 1, 2, 3}, "without min_p the unlikely tokens do come at this temperature"


def test_logprobs_are_well_formed_and_name_the_chosen_token():
    logits = _logits(5)
    picker = make_request_sampler(Settings(temperature=1.0, seed=9, logprobs=True, top_logprobs=5))
    assert isinstance(picker, TokenPicker)
    reference = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0].tolist()
    for _ in range(6):
        token = picker(logits).item()
        got = picker.take(token, str)
        assert got.token == str(token) and math.isclose(got.logprob, reference[token], abs_tol=1e-5)
        assert got.logprob <= 0 and all(t.logprob <= 0 for t in got.top)
        assert len(got.top) == 5 and [t.logprob for t in got.top] == sorted((t.logprob for t in got.top), reverse=True)
        best = sorted(range(VOCAB), key=lambda i: -reference[i])[:5]
        assert [t.token for t in got.top] == [str(i) for i in best]


def test_logprobs_at_temperature_0_keep_the_greedy_token_and_it_tops_its_list():
    logits = _logits(6)
    picker = make_request_sampler(Settings(logprobs=True, top_logprobs=3))
    assert picker is not greedy
    tokens = _draw(picker, logits, 3)
    assert tokens == [_best(logits)] * 3
    for token in tokens:
        got = picker.take(token, str)
        assert got.top[0].token == got.token and got.top[0].logprob == got.logprob
    zero = make_request_sampler(Settings(logprobs=True))
    token = zero(logits).item()
    assert zero.take(token, str).top == []


def test_logprobs_are_after_the_bias_before_the_temperature():
    """What the (steered) model thought: a forced token's logprob is about 0."""
    logits = _logits(7)
    picker = make_request_sampler(Settings(temperature=1.5, seed=1, logit_bias={3: 100.0}, logprobs=True))
    token = picker(logits).item()
    assert token == 3 and picker.take(token, str).logprob > -1e-3


def test_a_seeded_picker_draws_the_same_tokens_whatever_runs_beside_it():
    logits = _logits(8)
    settings = Settings(temperature=1.3, top_k=10, min_p=0.01, seed=42, presence_penalty=0.3)
    alone = _draw(make_request_sampler(settings, prompt=[1, 2]), logits, 12)
    again, other = make_request_sampler(settings, prompt=[1, 2]), make_request_sampler(Settings(temperature=1.0))
    mixed = []
    for _ in range(12):
        other(logits)
        mx.random.normal((4,))  # the global random state moves too
        mixed.append(again(logits).item())
    assert mixed == alone


def test_plain_greedy_requests_share_the_bare_greedy_function():
    """The batch's shared argmax is for rows whose sampler *is* greedy."""
    assert make_request_sampler(Settings()) is greedy
    assert make_request_sampler(Settings(top_k=5, min_p=0.2, top_p=0.5)) is greedy  # filters never move an argmax
    for changed in (Settings(logprobs=True), Settings(logit_bias={1: 1.0}), Settings(repetition_penalty=1.1),
                    Settings(presence_penalty=0.1), Settings(frequency_penalty=0.1), Settings(temperature=0.5)):
        assert make_request_sampler(changed) is not greedy, changed
    # a penalty that looks back on nothing is no penalty
    assert make_request_sampler(Settings(repetition_penalty=1.5, repetition_context_size=0)) is greedy


@pytest.mark.parametrize("settings, words", [
    (Settings(temperature=-1.0), "temperature"), (Settings(top_p=0.0), "top_p"), (Settings(top_k=-1), "top_k"),
    (Settings(min_p=1.5), "min_p"), (Settings(repetition_penalty=0.0), "repetition_penalty"),
    (Settings(repetition_penalty=math.inf), "repetition_penalty"),
    (Settings(presence_penalty=math.nan), "presence_penalty"),
    (Settings(frequency_context_size=-1), "frequency_context_size"),
    (Settings(logit_bias={VOCAB: 1.0}), "logit_bias: token id 64 is outside"),
    (Settings(logit_bias={1: math.inf}), "logit_bias"),
    (Settings(top_logprobs=MAX_TOP_LOGPROBS + 1), "top_logprobs")])
def test_settings_the_worker_cannot_use_are_named(settings, words):
    problem = check(settings, VOCAB)
    assert problem is not None and words in problem
    assert check(Settings(temperature=0.7, top_k=3, logit_bias={VOCAB - 1: -100.0}, top_logprobs=20), VOCAB) is None
