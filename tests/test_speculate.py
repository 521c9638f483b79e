"""Speculative decoding (worker/speculate.py): the n-gram drafter, the check of guesses, and greedy
output token-identical to plain decoding on real tiny models (CPU)."""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.protocol import Finished
from tests.engine_harness import OPEN, Run, drive
from worker.engine import Engine, EngineError
from worker.guess_check import accepted_count
from worker.speculate import EXPLORE, MAX_DRAFT, STALLS, Costs, NgramDrafter, Odds


def test_ngram_drafter_proposes_what_followed_the_latest_earlier_occurrence():
    drafter = NgramDrafter([2, 3, 4, 9, 2, 3, 7, 8, 5, 2, 3])
    assert drafter.propose(2) == [7, 8]  # the latest "2 3" before the suffix, not the first
    drafter = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert drafter.propose(2) == [4, 5]  # "1 2 3" was seen too: the longest n wins over a later "2 3"


def test_ngram_drafter_never_matches_the_suffix_itself_and_stops_at_the_text_end():
    drafter = NgramDrafter([5, 6])
    assert drafter.propose(4) == []  # only the suffix has "5 6"
    drafter.extend([5, 6])
    assert drafter.propose(4) == [5, 6]  # what followed the earlier "5 6", up to the end
    assert NgramDrafter([1, 2, 3, 4]).propose(3) == []
    assert NgramDrafter([4, 4, 1, 4]).propose(2) == [], "one shared token is no guess (MIN_NGRAM)"


def test_accepted_count_is_the_leading_guesses_the_model_chose_too():
    assert accepted_count([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_count([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_count([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_count([], [3]) == 0


def _engine(loaded, **kwargs) -> Engine:
    model, tokenizer = loaded
    return Engine(model, tokenizer, own_usage_fn=lambda: 0, **kwargs)


CACHED = Limits(max_concurrency=8, cache_cap=1 << 30)  # guard off, a prompt cache (H1)
PROMPTS = ["Once upon a time " * 6, "def main():\n    return main()\n" * 5, "the cat sat on the mat, the cat sat on"]


@pytest.mark.parametrize("text", PROMPTS)
@pytest.mark.parametrize("max_tokens", [7, 40])
def test_speculative_greedy_output_is_token_identical_to_plain_decoding(loaded, text, max_tokens):
    """Every token emitted is the model's greedy choice after the ones before it: with guesses
    checked or without, the same tokens, the same finish, and the guesses counted."""
    engine = _engine(loaded)
    prompt = engine.encode_prompt(text)
    runs = {}
    for rid, guess in (("plain", False), ("spec", True)):  # no prompt cache (OPEN): no reuse between them
        engine.submit(rid, prompt, max_tokens=max_tokens, speculative=guess)
        runs[rid] = drive(engine)
    plain, spec = runs["plain"], runs["spec"]
    assert spec.tokens("spec") == plain.tokens("plain")
    assert spec.text("spec") == plain.text("plain")
    end, plain_end = spec.terminal("spec"), plain.terminal("plain")
    assert isinstance(end, Finished) and end.finish_reason == plain_end.finish_reason
    assert plain_end.proposed_tokens == 0
    assert 0 <= end.accepted_tokens <= end.proposed_tokens
    if max_tokens == 40:
        assert end.proposed_tokens > 0 and end.accepted_tokens > 0, "the tiny model repeats itself: guesses land"


def test_speculative_steps_emit_several_tokens_per_pass(loaded):
    model, tokenizer = loaded
    calls = []

    class Counting:
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    engine = Engine(Counting(), tokenizer, own_usage_fn=lambda: 0)
    engine.submit("r", engine.encode_prompt(PROMPTS[0]), max_tokens=60)
    run = drive(engine)
    end = run.terminal("r")
    assert end.completion_tokens == 60 and end.accepted_tokens > 10
    assert len(calls) < 60 - end.accepted_tokens // 2, "accepted guesses cost no pass of their own"


def test_a_request_ending_inside_its_accepted_guesses_leaves_the_prompt_cache_a_consistent_entry(loaded):
    """The KV keeps exactly the tokens emitted: a request that ends at a stop string or its budget in
    the middle of accepted guesses stores prompt+output whose KV has the same length, and a later
    request reusing it replies as one that did not."""
    engine = _engine(loaded)
    prompt = engine.encode_prompt(PROMPTS[0])
    for max_tokens in (9, 10, 11, 12):
        engine.submit(f"r{max_tokens}", prompt, max_tokens=max_tokens)
        assert drive(engine, CACHED).terminal(f"r{max_tokens}").accepted_tokens > 0
    entries = engine.prompt_cache.recent_first()
    assert entries
    for entry in entries:
        assert entry.layers[0].offset == len(entry.tokens)
    engine.submit("again", prompt, max_tokens=30)
    again = drive(engine, CACHED)
    assert again.terminal("again").cached_tokens > 0
    engine.submit("fresh", prompt, max_tokens=30, speculative=False)
    assert again.tokens("again") == drive(engine).tokens("fresh")


def test_speculation_waits_while_another_request_decodes_beside_it(loaded):
    """Guesses are checked for a batch of one row only: two requests decode as a plain batch."""
    engine = _engine(loaded)
    for rid in ("a", "b"):
        engine.submit(rid, engine.encode_prompt(PROMPTS[0]), max_tokens=12)
    run = drive(engine)
    assert run.terminal("a").proposed_tokens == 0 == run.terminal("b").proposed_tokens


class _Oracle:
    """Guesses from a known reply: right for `right` tokens, then wrong ones (the verify must take
    the wrong ones back out), whatever the text says."""

    def __init__(self, prompt: list[int], reply: list[int], right: int, vocab: int) -> None:
        self.prompt, self.reply, self.right, self.vocab = prompt, reply, right, vocab
        self.asked = 0

    def propose(self, drafter: NgramDrafter, k: int) -> list[int]:
        done = len(drafter.tokens) - len(self.prompt)
        truth = self.reply[done:done + k]
        self.asked += 1
        right = (self.asked * self.right) % (k + 1)  # 0..k right ones, turn by turn
        return truth[:right] + [(t + 7) % self.vocab for t in truth[right:]]


@pytest.fixture(scope="module")
def changing(tiny_models):
    """tiny-b, whose greedy reply to this prompt changes token after 14 (random weights mostly
    repeat one token)."""
    import mlx_lm

    return mlx_lm.load(str(tiny_models.b))


CHANGING = "def main():\n    return main()\n" * 5


@pytest.mark.parametrize("right", [1, 2])
def test_wrong_guesses_are_taken_back_and_the_output_stays_the_plain_one(changing, monkeypatch, right):
    engine = _engine(changing)
    prompt = engine.encode_prompt(CHANGING)
    engine.submit("plain", prompt, max_tokens=30, speculative=False)
    plain = drive(engine)
    reply = plain.tokens("plain")
    assert len(set(reply)) > 1, "the reply changes token (else the check proves little)"
    oracle = _Oracle(prompt, reply, right, changing[0].args.vocab_size)
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, k: oracle.propose(self, k))
    monkeypatch.setattr(Odds, "length", lambda self, costs, most: most)  # keep guessing after misses
    engine.submit("spec", prompt, max_tokens=30)
    spec = drive(engine)
    assert spec.tokens("spec") == reply
    end = spec.terminal("spec")
    assert end.proposed_tokens > end.accepted_tokens > 0


def test_a_stop_inside_accepted_guesses_ends_there_and_the_prompt_cache_keeps_exactly_the_reply(changing, monkeypatch):
    """The KV keeps exactly the tokens emitted: a request whose stop string comes in the middle of
    guesses the model accepted stores prompt + reply with a KV of that length, and a later request
    reusing it replies as one that did not."""
    engine = _engine(changing)
    prompt = engine.encode_prompt(CHANGING)
    engine.submit("plain", prompt, max_tokens=30, speculative=False)
    reply = drive(engine).tokens("plain")
    change = next(i for i, t in enumerate(reply) if t != reply[0])
    stop = engine.tokenizer.decode([reply[change]])
    oracle = _Oracle(prompt, reply, 99, changing[0].args.vocab_size)  # always right
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, k: oracle.propose(self, k))
    monkeypatch.setattr(Odds, "length", lambda self, costs, most: min(6, most))
    engine.submit("spec", prompt, max_tokens=30, stop=[stop])
    run = drive(engine, CACHED)
    end = run.terminal("spec")
    assert end.finish_reason == "stop" and end.completion_tokens == change + 1
    assert end.accepted_tokens > 0
    entries = engine.prompt_cache.recent_first()
    assert entries and all(entry.layers[0].offset == len(entry.tokens) for entry in entries)
    assert entries[0].tokens == tuple(prompt + reply[:change + 1])
    monkeypatch.undo()
    engine.submit("again", prompt + reply[:change + 1], max_tokens=8, speculative=False)
    again = drive(engine, CACHED)
    assert again.terminal("again").cached_tokens == len(prompt) + change
    engine.submit("fresh", prompt + reply[:change + 1], max_tokens=8, speculative=False)
    assert again.tokens("again") == drive(engine).tokens("fresh")


# ------------------------------------------------------------------ the draft model (worker/draft.py)


@pytest.fixture(scope="module")
def with_draft(tiny_models):
    """tiny-a as the model, tiny-small (the same generated tokenizer) as its draft."""
    import mlx_lm

    from worker.draft import DraftModel

    model, tokenizer = mlx_lm.load(str(tiny_models.a))
    draft, _ = mlx_lm.load(str(tiny_models.small))
    return model, tokenizer, DraftModel(draft, str(tiny_models.small))


@pytest.mark.parametrize("text", PROMPTS)
def test_draft_model_guesses_are_checked_and_the_output_stays_the_plain_one(with_draft, monkeypatch, text):
    """With the text holding no guess (the n-gram drafter silenced), every guess is the draft
    model's; whatever it guesses, the reply is the model's own greedy one."""
    model, tokenizer, draft = with_draft
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0, draft=draft)
    prompt = engine.encode_prompt(text)
    engine.submit("plain", prompt, max_tokens=24, speculative=False)
    plain = drive(engine)
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, k: [])
    monkeypatch.setattr(Odds, "length", lambda self, costs, most: most)  # keep asking the draft after misses
    engine.submit("drafted", prompt, max_tokens=24)
    drafted = drive(engine)
    assert drafted.tokens("drafted") == plain.tokens("plain")
    end = drafted.terminal("drafted")
    assert end.proposed_tokens > 0 and 0 <= end.accepted_tokens <= end.proposed_tokens


def test_draft_state_is_rewound_to_the_tokens_the_model_kept(with_draft):
    model, tokenizer, draft = with_draft
    state = draft.state()
    context = tokenizer.encode("Once upon a time there was")
    guesses = draft.propose(state, context, 4)
    assert len(guesses) == 4 and state.tokens == len(context) + 3
    assert all(layer.offset == state.tokens for layer in state.cache)
    draft.rewind(state, len(context) + 1)  # the model kept one guess
    assert state.tokens == len(context) + 1 and all(layer.offset == len(context) + 1 for layer in state.cache)
    again = draft.propose(state, [*context, guesses[0], 77], 2)  # caught up on the token it had not seen
    fresh = draft.state()
    assert again == draft.propose(fresh, [*context, guesses[0], 77], 2)


def test_dropping_the_draft_under_pressure_keeps_every_reply_the_same(with_draft, monkeypatch):
    model, tokenizer, draft = with_draft
    engine = Engine(model, tokenizer, own_usage_fn=lambda: 0, draft=draft)
    prompt = engine.encode_prompt(PROMPTS[1])
    engine.submit("plain", prompt, max_tokens=20, speculative=False)
    plain = drive(engine).tokens("plain")
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, k: [])
    engine.submit("r", prompt, max_tokens=20)
    run = Run()
    for _ in range(3):
        run.add(engine.step(OPEN, lambda: 0))
    assert engine.drop_draft() and engine.draft is None and not engine.drop_draft()
    run.add(drive(engine).events)
    assert run.tokens("r") == plain


def test_a_draft_of_another_vocabulary_fails_the_load_saying_why(tiny_model, fim_model):
    with pytest.raises(EngineError) as refused:
        Engine.load(tiny_model, draft_path=str(fim_model))
    assert refused.value.code == "load_failed" and "draft model" in refused.value.message
    assert "vocabulary" in refused.value.message or "token ids" in refused.value.message


# ------------------------------------------------------------------ how much to guess (Costs, Odds)


def _costs(plain: float, **checks: float) -> Costs:
    """Costs as timed: a plain step of `plain` seconds and checks of `t<N>=seconds` (N tokens)."""
    costs = Costs()
    costs.learn_plain(plain)
    for name, seconds in checks.items():
        costs.learn_check(int(name[1:]), seconds)
    return costs


def _sure(right: int) -> Odds:
    """Odds after `right` unchecked guesses in a row that the plain steps proved right."""
    odds = Odds()
    for at in range(right):
        odds.guessed(7, at)
        odds.saw(7, at)
    return odds


def test_a_check_runs_only_where_its_timed_cost_promises_more_tokens_per_second_than_plain_steps():
    """Where a pass over K+1 tokens costs K+1 plain passes (MLX's quantized matmul on a CPU), no
    check can pay whatever the guesses: none runs. Where it costs about one (a float32 model with
    BLAS), a run of right guesses is checked as far as it may go; sizes not timed are read off
    the line through the nearest timed one."""
    sure = _sure(40)
    assert sure.chance(True) > 0.95
    assert sure.length(_costs(0.1, t3=0.3), MAX_DRAFT) == 0
    assert sure.length(_costs(0.1, t3=0.11, t17=0.18), MAX_DRAFT) == MAX_DRAFT
    q4 = _costs(0.1, t2=0.18, t3=0.252, t4=0.332)  # SmolLM2-135M Q4_1, MLX on this CPU
    assert sure.length(q4, MAX_DRAFT) > 0, "sure guesses still pay a little"
    assert Odds().length(q4, MAX_DRAFT) == 0, "even odds: no check of a quantized model pays"
    assert _costs(0.1, t3=0.2).ratio(5) == pytest.approx(3.0)  # 0.5 plain pass a token, from the 3-token check


def test_a_check_is_costed_in_plain_steps_of_its_own_moment():
    """On a shared machine a plain step's time moved 3x from one request to the next: a check is
    kept as its ratio to the plain steps around it, so the load changing later does not make
    checks look cheap or dear; one timed before any plain step is not kept, nor one slower than
    its tokens one at a time (a stall that would otherwise stop every check after it) unless
    several in a row say so."""
    costs = Costs()
    costs.learn_check(3, 0.5)
    assert not costs.checks
    costs.learn_plain(0.3)
    costs.learn_check(3, 0.6)
    for _ in range(30):  # the machine gets quiet: plain steps of 0.1 s
        costs.learn_plain(0.1)
    assert costs.plain == pytest.approx(0.1, rel=0.01)
    assert costs.ratio(3) == pytest.approx(2.0)
    costs.learn_check(5, 0.6)  # 6 passes for 5 tokens: a stall, not what such a pass costs
    assert 5 not in costs.checks and costs.ratio(5) == pytest.approx(3.0)
    for _ in range(STALLS):  # ... unless it keeps saying so
        costs.learn_check(5, 0.6)
    assert costs.ratio(5) == pytest.approx(6.0, rel=0.01)


def test_odds_are_learned_from_plain_steps_and_a_reply_that_stops_copying_stops_being_checked():
    """Whether an unchecked guess was right is known from the token the plain step produced: the
    odds follow the reply at no cost, so checks resume where copying starts and stop where it ends."""
    costs = _costs(0.1, t3=0.15)  # a quarter of a plain pass a guess
    odds = Odds()
    for at in range(20):  # the reply copies its prompt: every guess right
        odds.guessed(7, at)
        odds.saw(7, at)
    assert odds.length(costs, MAX_DRAFT) > 2
    for at in range(20, 30):  # the reply stops copying: every guess wrong
        odds.guessed(7, at)
        odds.saw(8, at)
    assert odds.chance(False) < 0.3 and odds.length(costs, MAX_DRAFT) == 0
    odds.guessed(7, 30)
    odds.saw(7, 31)  # a guess of another position (a step in a batch of several rows came between)
    assert odds.after_right is False and odds.chance(False) < 0.3
    odds.checked(4, 2)  # a check: two held, the third did not
    assert odds.after_right is False


def test_speculation_checks_nothing_where_a_check_costs_a_pass_per_token(loaded, monkeypatch):
    """The engine asks the worker's costs before each check: with every pass of K tokens costing
    K plain passes, a reply that repeats its prompt is decoded in plain steps, the same tokens."""
    engine = _engine(loaded)
    prompt = engine.encode_prompt(PROMPTS[0])
    engine.submit("plain", prompt, max_tokens=40, speculative=False)
    plain = drive(engine).tokens("plain")
    monkeypatch.setattr(Costs, "ratio", lambda self, tokens: float(tokens))
    engine.submit("spec", prompt, max_tokens=40)
    run = drive(engine)
    assert run.tokens("spec") == plain and run.terminal("spec").proposed_tokens == 0


def test_the_costs_are_timed_from_the_worker_s_own_passes(loaded):
    engine = _engine(loaded)
    engine.submit("r", engine.encode_prompt(PROMPTS[0]), max_tokens=60)
    assert drive(engine).terminal("r").accepted_tokens > 0
    costs = engine.decode.costs
    assert costs.plain > 0 and costs.checks and all(seconds > 0 for seconds in costs.checks.values())


def test_after_many_plain_steps_with_a_guess_one_check_runs_anyway():
    """Costs timed under another load (or a stall kept) must not stop checks for good: after
    EXPLORE plain steps that had a guess, the best size is checked even if it promises too little."""
    dear = _costs(0.1, t2=0.2)  # a pass per token: nothing pays
    odds = _sure(EXPLORE - 1)
    assert odds.length(dear, MAX_DRAFT) == 0
    odds.guessed(7, EXPLORE)
    assert odds.length(dear, MAX_DRAFT) > 0
    odds.checked(1, 1)
    assert odds.idle == 0 and odds.length(dear, MAX_DRAFT) == 0
