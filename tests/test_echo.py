"""Echo in the engine (worker/echo.py), on the tiny model (real MLX, CPU): a completion prompt
scored token by token, as lm-evaluation-harness's loglikelihood asks (`echo`, `logprobs`,
`max_tokens` 0 or 1), token-id prompts, and the logprob of an end-of-sequence token."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shared.limits import Limits
from shared.protocol import Echoed, Failed, Finished, Generate, Prompted, TokenOut
from shared.sizes import MiB
from worker.engine import Engine

OPEN = Limits(max_concurrency=8)
CACHED = Limits(max_concurrency=8, cache_cap=64 * MiB)  # the prompt cache on (H1)
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods " * 2


class Run:
    """Events of a run, per request, in order."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.by_id: dict[str, list] = {}
        for ev in events:
            self.by_id.setdefault(ev.request_id, []).append(ev)

    def tokens(self, rid: str) -> list[int]:
        return [ev.token_id for ev in self.by_id[rid] if isinstance(ev, TokenOut) and ev.token_id >= 0]

    def text(self, rid: str) -> str:
        return "".join(ev.text for ev in self.by_id[rid] if isinstance(ev, TokenOut))

    def terminal(self, rid: str):
        ends = [ev for ev in self.by_id[rid] if isinstance(ev, (Finished, Failed))]
        assert len(ends) == 1 and self.by_id[rid][-1] is ends[0], self.by_id[rid]
        return ends[0]


def drive(engine: Engine, limits: Limits = OPEN, max_steps: int = 2000) -> Run:
    events: list = []
    for _ in range(max_steps):
        if not engine.has_work:
            return Run(events)
        events += engine.step(limits, lambda: 0)
    raise AssertionError("engine still busy after max_steps")


def _engine(loaded, **kwargs) -> Engine:
    model, tokenizer = loaded
    return Engine(model, tokenizer, own_usage_fn=lambda: 0, **kwargs)


def reference(loaded, tokens: list[int], top: int) -> tuple[list[float], list[set[int]]]:
    """The prompt's logprobs from one forward pass of the whole prompt in this process (mlx_lm's
    model, float32 log-softmax): token i+1's given tokens 0..i, and the `top` best ids there."""
    model, _ = loaded
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = [logprobs[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)]
    best = [set(mx.argsort(-logprobs[i])[:top].tolist()) for i in range(len(tokens) - 1)]
    return chosen, best


def _echoed(run: Run, rid: str) -> Echoed:
    [echoed] = [ev for ev in run.by_id[rid] if isinstance(ev, Echoed)]
    return echoed


@pytest.mark.parametrize("max_chunk", [512, 16], ids=["one-chunk", "chunked"])
def test_echo_logprobs_equal_an_in_process_forward_and_the_first_token_has_none(loaded, max_chunk):
    """lm-evaluation-harness's loglikelihood: `echo` with `logprobs` and max_tokens 0 gives only the
    prompt's logprobs, each within 1e-3 of a forward pass in this process, chunked or not."""
    engine = _engine(loaded, max_chunk=max_chunk)
    tokens = engine.encode_prompt(TEXT)
    assert len(tokens) > 3 * 16
    engine.submit_generate(Generate(request_id="e", prompt_tokens=tokens, max_tokens=0, echo=True, logprobs=True,
                                    top_logprobs=3))
    run = drive(engine)
    echoed, end = _echoed(run, "e"), run.terminal("e")
    chosen, best = reference(loaded, tokens, 3)
    assert len(echoed.tokens) == len(tokens) and len(echoed.logprobs) == len(tokens) - 1
    assert max(abs(a.logprob - b) for a, b in zip(echoed.logprobs, chosen)) < 1e-3
    texts = engine.decode.texts
    assert [item.token for item in echoed.logprobs] == [texts(t) for t in tokens[1:]]
    assert echoed.tokens[0] == texts(tokens[0]) and echoed.text == engine.tokenizer.decode(tokens)
    for item, ids in zip(echoed.logprobs, best):
        assert len(item.top) == 3 and {t.token for t in item.top} == {texts(i) for i in ids}
        assert item.top[0].logprob >= item.logprob - 1e-6
    assert isinstance(end, Finished) and (end.finish_reason, end.prompt_tokens, end.completion_tokens) == (
        "length", len(tokens), 0)
    assert not any(isinstance(ev, TokenOut) for ev in run.by_id["e"])
    assert engine.echoes.jobs == type(engine.echoes.jobs)() and "e" not in engine.endings.ids


def test_echo_then_generation_reuses_the_scored_prompt_and_generates_as_without_echo(loaded):
    """max_tokens 1 (lm-eval's own shape) and more: the reply is what it would be without echo,
    and with the prompt cache on the scoring's KV is its prefill (no second pass over the prompt)."""
    engine = _engine(loaded)
    tokens = engine.encode_prompt(TEXT)
    engine.submit("plain", tokens, max_tokens=5)
    plain = drive(engine, CACHED)
    engine.prompt_cache.drop_lru(0)
    engine.submit_generate(Generate(request_id="e", prompt_tokens=tokens, max_tokens=5, echo=True, logprobs=True))
    run = drive(engine, CACHED)
    assert run.tokens("e") == plain.tokens("plain") and run.text("e") == plain.text("plain")
    [prompted] = [ev for ev in run.by_id["e"] if isinstance(ev, Prompted)]
    assert prompted.cached_tokens == len(tokens) - 1
    assert len(_echoed(run, "e").logprobs) == len(tokens) - 1
    assert run.by_id["e"].index(_echoed(run, "e")) < run.by_id["e"].index(prompted)
    assert run.terminal("e").completion_tokens == 5


def test_echo_without_logprobs_is_the_prompt_text_and_a_token_prompt_generates_as_its_text(loaded):
    engine = _engine(loaded)
    tokens = engine.encode_prompt("Hello there, general")
    engine.submit_generate(Generate(request_id="text", prompt="Hello there, general", max_tokens=4))
    engine.submit_generate(Generate(request_id="ids", prompt_tokens=tokens, max_tokens=4, echo=True))
    run = drive(engine)
    assert run.tokens("ids") == run.tokens("text")
    echoed = _echoed(run, "ids")
    assert echoed.text == engine.tokenizer.decode(tokens) and echoed.tokens == [] and echoed.logprobs == []


def test_an_eos_that_ends_the_reply_reports_its_logprob(loaded):
    """The greedy first token was the end-of-sequence token: `completion_tokens` 1 and no
    logprobs at all. Its logprob now comes with it (its text is never part of the reply)."""
    engine = _engine(loaded)
    eos = engine.tokenizer.eos_token_id
    engine.submit_generate(Generate(request_id="r", prompt="Hi", max_tokens=4, logprobs=True, top_logprobs=2,
                                    logit_bias={eos: 50.0}))
    run = drive(engine)
    end = run.terminal("r")
    [token] = [ev for ev in run.by_id["r"] if isinstance(ev, TokenOut)]
    assert isinstance(end, Finished) and end.finish_reason == "stop" and end.completion_tokens == 1
    assert token.text == "" and token.token_id == eos
    assert token.logprobs.token == engine.decode.texts(eos) and token.logprobs.logprob == pytest.approx(0, abs=1e-3)
    assert len(token.logprobs.top) == 2


def test_an_echo_aborted_while_scored_ends_once_and_frees_its_id(loaded):
    engine = _engine(loaded, max_chunk=16)
    tokens = engine.encode_prompt(TEXT)
    engine.submit_generate(Generate(request_id="e", prompt_tokens=tokens, max_tokens=2, echo=True, logprobs=True))
    first = engine.step(OPEN, lambda: 0)
    assert not any(isinstance(ev, (Echoed, Finished, Failed)) for ev in first) and engine.has_work
    assert engine.abort("e", "client went away")
    run = drive(engine)
    end = run.terminal("e")
    assert isinstance(end, Failed) and end.code == "aborted" and not engine.has_work
    assert "e" not in engine.endings.ids and not any(isinstance(ev, Echoed) for ev in run.events)


@pytest.mark.parametrize("cmd, words", [
    (Generate(request_id="r", prompt="x", max_tokens=0), "max_tokens must be at least 1"),
    (Generate(request_id="r", prompt="x", suffix="y", echo=True, max_tokens=0), "echo"),
    (Generate(request_id="r", prompt_tokens=[1, 2], prompt="x"), "exactly one of"),
    (Generate(request_id="r", prompt_tokens=[], echo=True, max_tokens=0), "empty"),
    (Generate(request_id="r", prompt_tokens=[1, 10**6], echo=True, max_tokens=0, logprobs=True), "outside"),
])
def test_bad_echoes_and_token_prompts_are_refused_naming_why(loaded, cmd, words):
    engine = _engine(loaded)
    engine.submit_generate(cmd)
    end = drive(engine).terminal("r")
    assert isinstance(end, Failed) and end.code == "invalid_request" and words in end.message
