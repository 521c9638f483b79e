"""Embeddings in one process: the folder's facts (shared.embedding), the guard's
arithmetic for a batch of inputs (worker.embed_guard, SPEC G1-G3), the worker's Embedder
on a generated tiny BERT with real MLX, checked against the numpy reference
(tests/bert_reference.py), and the front door's reading of OpenAI's `input`.

The real all-MiniLM-L6-v2 through real processes and both SDKs: live/test_embeddings_live.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.embedding import MAX_EMBED_INPUTS, WRONG_MODEL_KIND, EmbeddingSpec, read_embedding_spec
from shared.limits import Limits
from shared.protocol import Embed, Embedded, Failed, Generate, NeedMemory
from shared.sizes import GiB, MiB
from supervisor.http.embeddings import Inputs, check_request, inputs
from supervisor.http.errors import ApiError
from supervisor.http.openai_types import BodyError
from tests.bert_reference import NumpyBert, cosine
from worker import embed_guard as eg

OPEN = Limits(max_concurrency=8)  # guard off, room for everyone
SENTENCES = ["A man is eating food.", "the quick brown fox jumps over the lazy dog",
             "Memory is guarded per worker process.", "hi"]


@pytest.fixture(scope="module")
def tiny_embedder_dir(tmp_path_factory):
    from modelfiles.embedgen import make_embedding_model

    return make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-embed", matryoshka=(16, 32),
                                max_seq_length=32)


@pytest.fixture
def embedder(tiny_embedder_dir):
    from worker.embedder import Embedder

    return Embedder.load(tiny_embedder_dir, max_concurrency=8, own_usage_fn=lambda: 0, reclaim_fn=lambda: 0)


def drive(embedder, limits: Limits = OPEN, usage_fn=lambda: 0, max_steps: int = 500) -> list:
    events: list = []
    for _ in range(max_steps):
        if not embedder.has_work:
            return events
        events += embedder.step(limits, usage_fn)
    raise AssertionError("the embedder never ran out of work")


def vectors(msg: Embedded) -> np.ndarray:
    return np.frombuffer(msg.vectors, dtype="<f4").reshape(len(msg.token_counts), msg.dimensions)


def by_id(events) -> dict:
    return {e.request_id: e for e in events}


# ---------------------------------------------------------------- the folder's facts


def test_a_sentence_transformers_folder_is_an_embedding_model_with_its_pooling_and_limits(tiny_embedder_dir):
    spec = read_embedding_spec(tiny_embedder_dir)
    assert spec == EmbeddingSpec(family="bert", dims=64, pooling="mean", normalize=True, max_tokens=32,
                                 matryoshka=(16, 32))


def test_a_chat_model_folder_is_not_an_embedding_model(tiny_model):
    assert read_embedding_spec(tiny_model) is None


def test_pooling_normalize_and_limits_come_from_the_st_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32,
                                                      "max_position_embeddings": 64,
                                                      "matryoshka_dimensions": [8, 99, "x", 16]}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Transformer", "path": ""},
        {"type": "sentence_transformers.models.Pooling", "path": "pool"}]))
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                               "pooling_mode_mean_tokens": False}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    spec = read_embedding_spec(tmp_path)
    # no Normalize module; max_seq_length past the position table is cut to it; dims over 32 dropped
    assert spec == EmbeddingSpec(family="bert", dims=32, pooling="cls", normalize=False, max_tokens=64,
                                 matryoshka=(8, 16))
    (tmp_path / "modules.json").write_text("[{")
    assert read_embedding_spec(tmp_path) is None


def test_dimensions_allowed_only_where_the_model_was_trained_and_the_cap_follows_the_width():
    plain = EmbeddingSpec(family="bert", dims=384, pooling="mean", normalize=True, max_tokens=256)
    assert plain.allows_dimensions(384) and not plain.allows_dimensions(128)
    mat = EmbeddingSpec(family="bert", dims=768, pooling="mean", normalize=True, max_tokens=512,
                        matryoshka=(256, 512))
    assert mat.allows_dimensions(256) and not mat.allows_dimensions(300)
    assert plain.input_cap() == MAX_EMBED_INPUTS
    # a reply is one frame: 768 float32 values a row leave room for 1,024 rows in 3 MiB
    assert mat.input_cap() == 1024 and mat.input_cap(256) == MAX_EMBED_INPUTS


# ---------------------------------------------------------------- G1-G3 arithmetic

LIMITS = Limits(soft_limit=9 * GiB, hard_limit=10 * GiB, hard_watermark=int(9.5 * GiB), abort_limit=12 * GiB,
                abort_margin=0.93, prefill_headroom_safety=0.92, ceiling=10 * GiB, static=12 * GiB,
                dynamic=10 * GiB, binding="dynamic")
COST = eg.EmbedCost(per_token=64 * 1024, per_pair=64)


def test_g1_one_row_that_fits_goes_and_guard_off_lets_everything_through():
    assert eg.first_row(LIMITS, 5 * GiB, 1 * GiB, COST, 512, retried=False).verdict == "fits"
    assert eg.first_row(Limits(), 100 * GiB, 100 * GiB, COST, 10**6, retried=False).verdict == "fits"


def test_g1_a_row_over_the_limit_asks_for_eviction_of_the_shortfall_then_is_refused():
    row = eg.padded_step_bytes(COST, 1, 4096)
    usage = 10 * GiB - row // 2
    verdict = eg.first_row(LIMITS, usage, 1 * GiB, COST, 4096, retried=False)
    assert verdict.verdict == "evict" and verdict.need_bytes == usage + row - 10 * GiB > 0
    assert eg.first_row(LIMITS, usage, 1 * GiB, COST, 4096, retried=True).verdict == "reject"


def test_g1_a_row_that_would_not_fit_even_alone_is_refused_at_once():
    huge = eg.padded_step_bytes(COST, 1, 200_000)
    assert huge > 10 * GiB
    verdict = eg.first_row(LIMITS, 2 * GiB, 1 * GiB, COST, 200_000, retried=False)
    assert verdict.verdict == "reject" and verdict.limit_bytes == 10 * GiB and verdict.binding == "dynamic"


def test_g2_a_step_takes_rows_within_the_token_budget():
    assert eg.rows_for_step(OPEN, 0, COST, [100] * 50, token_budget=1000) == 10
    assert eg.rows_for_step(OPEN, 0, COST, [3000, 10], token_budget=1000) == 1  # the first row always goes


def test_g2_a_step_takes_only_the_rows_whose_padded_cost_fits_under_the_chunk_target():
    target = min(int(10 * GiB * 0.92), int(12 * GiB * 0.93))
    usage = target - 5 * eg.padded_step_bytes(COST, 1, 512)
    rows = eg.rows_for_step(LIMITS, usage, COST, [512] * 40, token_budget=10**9)
    assert rows == 5
    assert usage + eg.padded_step_bytes(COST, rows, 512) <= target < usage + eg.padded_step_bytes(COST, 6, 512)


def test_g2_learning_raises_the_scale_at_once_and_eases_it_down():
    raw = eg.step_bytes(COST, 4, 100, scaled=False)
    up = eg.learn(COST, 3 * raw, 4, 100)
    assert up.scale == pytest.approx(3.0) and up.measured
    down = eg.learn(up, raw, 4, 100)
    assert 1.0 < down.scale < 3.0
    assert eg.learn(COST, raw // 10, 4, 100).scale == 1.0  # never below the model


# ---------------------------------------------------------------- the Embedder (real MLX)


def test_vectors_match_the_numpy_reference_and_pad_nothing_into_a_row(embedder, tiny_embedder_dir):
    """Rows of different lengths share a padded batch; each equals the reference of the input alone."""
    embedder.submit_embed(Embed(request_id="r", texts=SENTENCES))
    [out] = drive(embedder)
    ref = NumpyBert(tiny_embedder_dir)
    got = vectors(out)
    assert out.dimensions == 64 and out.token_counts == [len(ref.tokens(s)) for s in SENTENCES]
    for row, sentence in zip(got, SENTENCES):
        assert cosine(row, ref.embed(sentence)) > 0.99999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_token_ids_are_taken_as_they_are(embedder, tiny_embedder_dir):
    ref = NumpyBert(tiny_embedder_dir)
    ids = ref.tokens(SENTENCES[0])
    embedder.submit_embed(Embed(request_id="ids", token_ids=[ids, ids[1:-1]]))
    embedder.submit_embed(Embed(request_id="text", texts=[SENTENCES[0]]))
    got = by_id(drive(embedder))
    assert np.allclose(vectors(got["ids"])[0], vectors(got["text"])[0], atol=1e-5)
    assert cosine(vectors(got["ids"])[1], ref.embed_ids(ids[1:-1])) > 0.99999  # no [CLS]/[SEP] added
    assert got["ids"].token_counts == [len(ids), len(ids) - 2]


def test_matryoshka_dimensions_are_the_prefix_at_unit_length_and_others_are_refused(embedder):
    embedder.submit_embed(Embed(request_id="full", texts=SENTENCES[:2]))
    embedder.submit_embed(Embed(request_id="cut", texts=SENTENCES[:2], dimensions=16))
    embedder.submit_embed(Embed(request_id="bad", texts=SENTENCES[:2], dimensions=20))
    got = by_id(drive(embedder))
    full, cut = vectors(got["full"]), vectors(got["cut"])
    assert cut.shape == (2, 16)
    prefix = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert np.allclose(cut, prefix, atol=1e-5)
    assert isinstance(got["bad"], Failed) and got["bad"].code == "invalid_request" and "20" in got["bad"].message


def test_an_input_over_the_limit_is_refused_or_cut_where_the_request_says_truncate(embedder):
    long = "memory " * 60
    embedder.submit_embed(Embed(request_id="refused", texts=["short", long]))
    embedder.submit_embed(Embed(request_id="cut", texts=[long], truncate=True))
    embedder.submit_embed(Embed(request_id="ids", token_ids=[[5] * 40], truncate=True))
    got = by_id(drive(embedder))
    assert isinstance(got["refused"], Failed) and got["refused"].code == "context_length_exceeded"
    assert "input 1" in got["refused"].message and "32" in got["refused"].message
    assert got["cut"].token_counts == [32] and got["ids"].token_counts == [32]


def test_bad_inputs_fail_their_request_alone(embedder):
    embedder.submit_embed(Embed(request_id="none", texts=[]))
    embedder.submit_embed(Embed(request_id="both", texts=["a"], token_ids=[[1]]))
    embedder.submit_embed(Embed(request_id="vocab", token_ids=[[1, 10**6]]))
    embedder.submit_embed(Embed(request_id="ok", texts=["fine"]))
    got = by_id(drive(embedder))
    assert {k: type(v).__name__ for k, v in got.items()} == {
        "none": "Failed", "both": "Failed", "vocab": "Failed", "ok": "Embedded"}


def test_a_chat_request_to_an_embedding_model_is_wrong_model_kind(embedder):
    embedder.submit_generate(Generate(request_id="g", prompt="hello"))
    [failed] = drive(embedder)
    assert isinstance(failed, Failed) and failed.code == WRONG_MODEL_KIND and "/v1/embeddings" in failed.message


def test_requests_share_a_batch_and_each_gets_its_own_vectors(embedder):
    for i, sentence in enumerate(SENTENCES):
        embedder.submit_embed(Embed(request_id=f"r{i}", texts=[sentence]))
    steps = 0
    events: list = []
    while embedder.has_work:
        events += embedder.step(OPEN, lambda: 0)
        steps += 1
    alone = {}
    for i, sentence in enumerate(SENTENCES):
        embedder.submit_embed(Embed(request_id=f"a{i}", texts=[sentence]))
        alone[i] = vectors(drive(embedder)[0])[0]
    assert steps < len(SENTENCES)  # fewer forwards than requests
    for e in events:
        assert np.allclose(vectors(e)[0], alone[int(e.request_id[1:])], atol=1e-5)


def test_g2_a_big_batch_is_split_over_steps_under_a_tight_chunk_target(embedder):
    """Only a few rows' activations fit above the usage: the batch runs over several steps,
    and commands (abort, reclaim) get their step boundaries in between."""
    one = eg.padded_step_bytes(embedder.cost, 1, 12)
    limits = Limits(hard_limit=1 * GiB, abort_limit=2 * GiB, soft_limit=1 * GiB, abort_margin=1.0,
                    prefill_headroom_safety=1.0, max_concurrency=8)
    usage = 1 * GiB - 3 * one  # room for about three rows
    embedder.submit_embed(Embed(request_id="big", texts=["the same words again"] * 24))
    steps, events = 0, []
    while embedder.has_work:
        events += embedder.step(limits, lambda: usage)
        steps += 1
    [done] = events
    assert isinstance(done, Embedded) and len(done.token_counts) == 24
    assert steps >= 6


def test_g1_a_row_that_does_not_fit_asks_for_memory_once_then_is_refused(embedder):
    limits = Limits(hard_limit=64 * MiB, abort_limit=1 * GiB, soft_limit=60 * MiB, abort_margin=1.0,
                    prefill_headroom_safety=1.0, max_concurrency=8, binding="dynamic")
    usage = 64 * MiB - eg.padded_step_bytes(embedder.cost, 1, 32) // 2
    embedder.submit_embed(Embed(request_id="big", texts=["words " * 40], truncate=True))  # 32 tokens
    [need] = embedder.step(limits, lambda: usage)
    assert isinstance(need, NeedMemory) and need.need_bytes > 0
    assert not embedder.has_work and embedder.next_deadline() is not None  # waits for the answer
    embedder.memory_answer("big", evicted=False)
    [failed] = drive(embedder, limits, lambda: usage)
    assert isinstance(failed, Failed) and failed.code == "prefill_memory_exceeded"
    assert failed.binding == "dynamic" and failed.limit_bytes == 64 * MiB and "input batch" in failed.message


def test_g3_over_the_abort_limit_after_a_step_fails_what_ran(tiny_embedder_dir):
    from worker.embedder import Embedder

    reclaimed = []
    embedder = Embedder.load(tiny_embedder_dir, own_usage_fn=lambda: 0, reclaim_fn=lambda: reclaimed.append(1) or 0)
    limits = Limits(hard_limit=1 * GiB, abort_limit=1 * GiB, soft_limit=1 * GiB, max_concurrency=8)
    readings = iter([0, 2 * GiB, 2 * GiB])  # before the step, after it, after the reclaim
    embedder.submit_embed(Embed(request_id="r", texts=["x"]))
    [failed] = embedder.step(limits, lambda: next(readings))
    assert isinstance(failed, Failed) and failed.code == "prefill_memory_exceeded" and reclaimed


def test_abort_and_p3_paused_admission(embedder):
    embedder.submit_embed(Embed(request_id="one", texts=["a"]))
    embedder.submit_embed(Embed(request_id="two", texts=["b"]))
    paused = Limits(max_concurrency=8, admission_paused=True)
    [first] = embedder.step(paused, lambda: 0)  # admits one (nothing ran) and not the other beside it
    assert isinstance(first, Embedded) and first.request_id == "one" and embedder.queued == 1
    assert embedder.abort("two", "client went away", code="client_disconnected")
    events = drive(embedder, paused)
    assert {e.request_id: type(e).__name__ for e in events} == {"two": "Failed"}
    assert not embedder.abort("nobody", "x")


# ---------------------------------------------------------------- the front door's reading


def test_openai_input_in_each_of_its_four_forms():
    assert inputs("hi") == Inputs(texts=["hi"])
    assert inputs(["a", "b"]) == Inputs(texts=["a", "b"])
    assert inputs([1, 2, 3]) == Inputs(token_ids=[[1, 2, 3]])
    assert inputs([[1, 2], [3]]) == Inputs(token_ids=[[1, 2], [3]])


@pytest.mark.parametrize("bad", ["", [], ["a", ""], ["a", 1], [[1], []], [-1], [True], [[1, "x"]], {"a": 1}, 3])
def test_openai_input_that_is_none_of_them_is_a_400_naming_input(bad):
    with pytest.raises(BodyError) as err:
        inputs(bad)
    assert err.value.param == "input"


def test_the_models_facts_refuse_a_chat_model_dimensions_and_too_many_inputs():
    spec = EmbeddingSpec(family="bert", dims=384, pooling="mean", normalize=True, max_tokens=256)
    with pytest.raises(ApiError) as kind:
        check_request(None, "chat", Inputs(texts=["x"]), None)
    assert kind.value.status == 400 and kind.value.code == WRONG_MODEL_KIND and kind.value.param == "model"
    with pytest.raises(BodyError) as dims:
        check_request(spec, "minilm", Inputs(texts=["x"]), 128)
    assert dims.value.param == "dimensions" and "Matryoshka" in str(dims.value)
    with pytest.raises(BodyError) as many:
        check_request(spec, "minilm", Inputs(texts=["x"] * (MAX_EMBED_INPUTS + 1)), None)
    assert many.value.param == "input" and str(MAX_EMBED_INPUTS) in str(many.value)
    check_request(spec, "minilm", Inputs(texts=["x"] * MAX_EMBED_INPUTS), 384)


def test_every_field_of_the_sdks_embedding_request_is_declared_and_honoured_or_accepted():
    """As test_api_fields walks chat: a field a future SDK adds fails here until decided."""
    from openai.types.embedding_create_params import EmbeddingCreateParams

    from supervisor.http.embeddings import EmbeddingRequest

    sdk = set(EmbeddingCreateParams.__required_keys__ | EmbeddingCreateParams.__optional_keys__)
    honoured, accepted = {"model", "input", "dimensions", "encoding_format"}, {"user"}
    assert sdk == honoured | accepted
    assert sdk <= set(EmbeddingRequest.__struct_fields__)


def test_an_empty_string_among_the_inputs_is_a_400_on_both_apis(tiny_embedder_dir, tmp_path_factory):
    """`/api/embed` with `[""]` was a 200 with no vector (read as Ollama's empty request) while
    `/v1/embeddings` refused it: both now read `input` with the same `inputs` and refuse it,
    before any worker starts. Ollama's own empty request (no input, "" or []) still only loads."""
    from supervisor.config import ModelConfig
    from tests.http_harness import LiveServer, make_config

    config = make_config([ModelConfig(id="emb", path=str(tiny_embedder_dir))], http="127.0.0.1:0")
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        async def main():
            async with live.client() as c:
                return {(path, repr(given)): await c.post(path, json={"model": "emb", "input": given})
                        for path in ("/v1/embeddings", "/api/embed") for given in ([""], ["a", ""], ["", "b"])}

        answers = live.run(main())
        started = live.arbiter.pool.worker_for("emb")
    for (path, given), r in answers.items():
        body = r.json()
        assert r.status_code == 400, (path, given, body)
        error = body["error"] if path == "/v1/embeddings" else body  # OpenAI's shape, Ollama's
        message = error["message"] if path == "/v1/embeddings" else error["error"]
        assert error["param"] == "input" and message == "input: strings must not be empty", (path, given)
    assert started is None  # refused at the door: no worker was started for them
