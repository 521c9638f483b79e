"""The worker's MLX engine on real tiny models (CPU), when a request ends early: aborts wherever
the request is, bad input, a tokenizer that raises, a model without a chat template, a failed
load, an MLX failure mid-step; each fails its own requests and the engine keeps serving."""

from __future__ import annotations

import pytest

from shared.limits import Limits
from shared.protocol import ChatMessage, Failed, Finished, Generate
from tests.engine_harness import Run, drive, engine_for
from tests.engine_harness import prompt_tokens as _prompt
from worker.engine import Engine, EngineError

# ------------------------------------------------------------------ aborts and bad input


def test_abort_gives_exactly_one_terminal_failed_wherever_the_request_is(loaded):
    engine = engine_for(loaded)
    for rid in ("decoding", "queued"):
        engine.submit(rid, _prompt(engine), max_tokens=50)
    limits = Limits(max_concurrency=1)
    run = Run()
    while engine.tokens_total < 2:
        run.add(engine.step(limits, lambda: 0))
    assert engine.abort("decoding", "pressure", code="aborted")
    assert engine.abort("queued", "pressure")
    assert not engine.abort("never-seen", "x")
    run.add(drive(engine, limits).events)
    for rid in ("decoding", "queued"):
        end = run.terminal(rid)
        assert isinstance(end, Failed) and (end.code, end.message) == ("aborted", "pressure")
    assert engine.running == engine.queued == 0


def test_abort_all_and_abort_queued(loaded):
    engine = engine_for(loaded)
    for i in range(3):
        engine.submit(f"r{i}", _prompt(engine), max_tokens=50)
    limits = Limits(max_concurrency=1)
    run = Run()
    run.add(engine.step(limits, lambda: 0))
    assert engine.abort_queued("unloading", code="model_unloading") == 2
    run.add(engine.step(limits, lambda: 0))
    assert engine.abort_all("emergency") == 1
    run.add(drive(engine, limits).events)
    assert [run.terminal(f"r{i}").code for i in range(3)] == ["aborted", "model_unloading",
                                                              "model_unloading"]


@pytest.mark.parametrize(
    "cmd, fragment",
    [
        (Generate(request_id="x"), "exactly one of messages or prompt"),
        (Generate(request_id="x", prompt="a", messages=[ChatMessage(role="user", content="b")]),
         "exactly one"),
        (Generate(request_id="x", prompt="hi", max_tokens=0), "max_tokens"),
        (Generate(request_id="x", prompt="hi", temperature=-1.0), "temperature"),
        (Generate(request_id="x", prompt="hi", top_p=0.0), "top_p"),
        (Generate(request_id="x", messages=[]), "messages must not be empty"),
    ],
)
def test_bad_generate_becomes_one_invalid_request_failure(loaded, cmd, fragment):
    engine = engine_for(loaded)
    engine.submit_generate(cmd)
    end = drive(engine).terminal("x")
    assert isinstance(end, Failed) and end.code == "invalid_request"
    assert fragment in end.message


class _BrokenTokenizer:
    """The real tokenizer, except that encoding `text` raises (a tokenizer bug)."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text = tokenizer, text

    def encode(self, text, **kwargs):
        if text == self.text:
            raise IndexError("tokenizer bug")
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_generate_that_cannot_be_prepared_fails_alone_and_the_engine_keeps_serving(loaded):
    """Anything raised while taking a Generate escapes into the worker's command
    loop and kills the worker with every stream on it (a negative seed did)."""
    model, tokenizer = loaded
    engine = Engine(model, _BrokenTokenizer(tokenizer, "boom"), own_usage_fn=lambda: 0)
    engine.submit_generate(Generate(request_id="ok", prompt="fine", max_tokens=3))
    engine.submit_generate(Generate(request_id="bad", prompt="boom", max_tokens=3))
    run = drive(engine)
    bad = run.terminal("bad")
    assert isinstance(bad, Failed) and bad.code == "engine_error" and "tokenizer bug" in bad.message
    assert isinstance(run.terminal("ok"), Finished)


def test_duplicate_request_id_and_out_of_vocab_tokens_are_refused(loaded):
    engine = engine_for(loaded)
    engine.submit("same", [1, 2, 3], max_tokens=2)
    with pytest.raises(EngineError, match="already in use"):
        engine.submit("same", [1, 2, 3])
    with pytest.raises(EngineError, match="outside"):
        engine.submit("big", [10**7])
    drive(engine)


def test_model_without_chat_template_refuses_chat(tmp_path, tiny_model):
    import json
    import shutil

    copy = tmp_path / "plain"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine.load(copy, own_usage_fn=lambda: 0)
    with pytest.raises(EngineError, match="no chat template"):
        engine.encode_chat([{"role": "user", "content": "hi"}])


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(EngineError, match="config.json not found") as info:
        Engine.load(tmp_path / "nowhere")
    assert info.value.code == "load_failed"


# ------------------------------------------------------------------ an MLX failure mid-step


class _FailingModel:
    """The real model, except that call number `fail_at` raises as an MLX allocation failure
    would (fault injection: MLX on CPU reports malloc failure as RuntimeError)."""

    def __init__(self, model, fail_at: int):
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes.")
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("fail_at", [1, 2, 3])  # prefill chunk, first token, a decode step
def test_mlx_failure_fails_the_requests_involved_and_the_engine_keeps_serving(loaded, fail_at):
    """An exception escaping `step()` would kill the worker and every stream on it."""
    model, tokenizer = loaded
    reclaims = []
    engine = Engine(_FailingModel(model, fail_at), tokenizer, max_chunk=64, own_usage_fn=lambda: 0,
                    reclaim_fn=lambda: reclaims.append(1) or 0)
    engine.submit("hit", _prompt(engine, "a few words here"), max_tokens=4)
    end = drive(engine).terminal("hit")
    assert isinstance(end, Failed) and end.code == "engine_error" and "Unable to allocate" in end.message
    assert reclaims
    engine.submit("after", _prompt(engine), max_tokens=3)
    assert isinstance(drive(engine).terminal("after"), Finished)
