"""Fill in the middle: one table of FIM token spellings (shared/fim.py) decides
both what a model card promises (supervisor/http/modelfacts.py, from the model's files or
GGUF header) and how the worker builds the prompt (worker/prompts.encode_fim)."""

from __future__ import annotations

import json

import pytest

from shared import fim
from shared.sizes import MiB
from supervisor.http.modelfacts import gguf_facts, read_facts
from tests.gguf_harness import write_gguf
from worker import prompts
from worker.request import EngineError

QWEN = {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"}
STARCODER = {"<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>"}


@pytest.mark.parametrize("vocabulary, prefix", [
    (QWEN, "<|fim_prefix|>"),
    (STARCODER, "<fim_prefix>"),
    ({"<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"}, "<｜fim▁begin｜>"),
    ({"▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"}, "▁<PRE>"),
    ({"[PREFIX]", "[SUFFIX]"}, "[PREFIX]"),
], ids=["qwen", "starcoder-smollm", "deepseek", "codellama", "codestral"])
def test_fim_spelling_is_found_from_the_special_tokens(vocabulary, prefix):
    found = fim.find(vocabulary)
    assert found is not None and found.prefix == prefix
    assert found.order == ("spm" if prefix == "[PREFIX]" else "psm")


def test_no_spelling_without_all_its_tokens():
    assert fim.find({"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>"}) is None
    assert fim.find({"<fim_prefix>", "<fim_suffix>"}) is None  # no middle


@pytest.fixture(scope="module")
def tokenizers(fim_model, tiny_model):
    from mlx_lm.tokenizer_utils import load

    return load(fim_model), load(tiny_model)


def test_encode_fim_is_bos_prefix_suffix_middle_with_special_text_kept_as_text(tokenizers):
    tok, _ = tokenizers
    ids = tok.convert_tokens_to_ids
    pre, suf, mid = ids("<fim_prefix>"), ids("<fim_suffix>"), ids("<fim_middle>")
    prefix, suffix = "def add(a, b):\n    ", "\n    return c  # <fim_middle>"
    text = lambda s: tok.encode(s, add_special_tokens=False, split_special_tokens=True)  # noqa: E731
    got = prompts.encode_fim(tok, prefix, suffix)
    assert got == [tok.bos_token_id, pre, *text(prefix), suf, *text(suffix), mid]
    assert got.count(mid) == 1  # the suffix's "<fim_middle>" text did not become the token
    assert prompts.encode_fim(tok, "", "") == [tok.bos_token_id, pre, suf, mid]


def test_encode_fim_suffix_first_for_codestrals_spelling(tmp_path):
    from mlx_lm.tokenizer_utils import load

    from modelfiles.modelgen import make_model

    make_model(tmp_path / "spm", 2 * MiB, 0, extra_special=("[PREFIX]", "[SUFFIX]"))
    tok = load(tmp_path / "spm")
    text = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    got = prompts.encode_fim(tok, "a = 1", "b = 2")
    assert got == [tok.bos_token_id, tok.convert_tokens_to_ids("[SUFFIX]"), *text("b = 2"),
                   tok.convert_tokens_to_ids("[PREFIX]"), *text("a = 1")]


def test_encode_fim_without_fim_tokens_fails_with_the_code_the_front_door_names_suffix_by(tokenizers):
    _, plain = tokenizers
    with pytest.raises(EngineError) as err:
        prompts.encode_fim(plain, "a", "b")
    assert err.value.code == fim.FIM_UNSUPPORTED and "suffix" in err.value.message


def test_model_facts_say_insert_exactly_where_the_worker_builds_a_fim_prompt(fim_model, tiny_model, tmp_path):
    """A folder, the GGUF of the same model (its header's special tokens) and that GGUF's
    imported folder (added tokens only in tokenizer.json) all agree."""
    from modelfiles.gguf_import import import_gguf

    assert read_facts(str(fim_model)).fim and not read_facts(str(tiny_model)).fim
    write_gguf(fim_model, tmp_path / "fim.gguf")
    write_gguf(tiny_model, tmp_path / "plain.gguf")
    facts = gguf_facts(tmp_path / "fim.gguf")
    config = json.loads((fim_model / "config.json").read_text())
    assert facts.fim and facts.format == "gguf" and facts.family == "llama" and facts.has_template
    assert facts.context_length == config["max_position_embeddings"]
    assert facts.file_bytes == (tmp_path / "fim.gguf").stat().st_size
    assert not gguf_facts(tmp_path / "plain.gguf").fim
    import_gguf(tmp_path / "fim.gguf", tmp_path / "imported")
    assert "added_tokens_decoder" not in json.loads((tmp_path / "imported" / "tokenizer_config.json").read_text())
    assert read_facts(str(tmp_path / "imported")).fim


def test_completions_and_ollama_generate_carry_the_suffix_to_the_worker_untemplated():
    import msgspec

    from supervisor.http.completions import completion_generates
    from supervisor.http.ollama import OllamaGenerateRequest, generate_generate
    from supervisor.http.openai_types import BodyError, CompletionRequest, decode_body

    def body(**kw):
        return msgspec.json.encode({"model": "m", **kw})

    gen = completion_generates(decode_body(body(prompt="", suffix="tail"), CompletionRequest))[0].gen
    assert (gen.prompt, gen.suffix, gen.messages) == ("", "tail", None)  # an empty prefix is a file's top
    gen = generate_generate(decode_body(body(prompt="head", suffix="tail"), OllamaGenerateRequest)).gen
    assert (gen.prompt, gen.suffix, gen.messages) == ("head", "tail", None)
    with pytest.raises(BodyError) as err:
        generate_generate(decode_body(body(prompt="head", suffix="tail", system="s"), OllamaGenerateRequest))
    assert err.value.param == "system"
