"""Images through the real SDKs to a real vision worker: greedy output is mlx-vlm's own.

A real supervisor, its HTTP front door and a worker process running the tiny SmolVLM
(modelfiles/vlmgen.py); the openai SDK (chat `image_url` data URL, and Responses `input_image`),
the anthropic SDK (`image` block, base64) and the ollama client (`images`) each ask for a greedy
reply on the same image and prompt, which must be mlx-vlm's in-process `generate`, text and
token count alike. The reference runs in a process of its own (MLX in the test process would
change the supervisor's own footprint for later tests).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from supervisor.config import GuardConfig, ModelConfig
from tests.http_harness import LiveServer, make_config
from tests.image_harness import b64, data_url, image_bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

PROMPT = "Describe this image."
TOKENS = 12
PICTURE = image_bytes(120, 80, seed=11)

_REFERENCE = """
import io, json, sys
from PIL import Image
from mlx_vlm import generate, load
from mlx_vlm.prompt_utils import apply_chat_template
model, processor = load(sys.argv[1])
prompt = apply_chat_template(processor, model.config, sys.argv[2], num_images=1)
picture = Image.open(io.BytesIO(open(sys.argv[3], "rb").read()))
out = generate(model, processor, prompt, image=[picture], max_tokens=int(sys.argv[4]), temperature=0.0, verbose=False)
eos = set(model.config.eos_token_id or [])
tokens = list(out.token_ids)
shown = [t for t in tokens if t not in eos]
print(json.dumps({"text": processor.tokenizer.decode(shown), "tokens": tokens}))
"""


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    config = make_config([ModelConfig(id="eyes", path=str(tiny_vlm), max_concurrency=4)],
                         guard=GuardConfig(hot_cache_max="64MiB"))  # a prompt cache (H1)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        yield live


@pytest.fixture(scope="module")
def reference(tiny_vlm, tmp_path_factory) -> tuple[str, int]:
    """mlx-vlm's greedy text on PICTURE and PROMPT, and how many tokens it generated."""
    picture = tmp_path_factory.mktemp("img") / "picture.png"
    picture.write_bytes(PICTURE)
    out = subprocess.run([sys.executable, "-c", _REFERENCE, str(tiny_vlm), PROMPT, str(picture), str(TOKENS)],
                         capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["text"], len(result["tokens"])


def same_text(served: str, expected: str) -> bool:
    """mlx-lm's streaming detokenizer drops the one space a reply starts with (the text engine's
    tests say so too); everything else must match."""
    return served == expected or served == expected.removeprefix(" ")


def test_vision_openai_sdk_chat_image_url_is_mlx_vlms_greedy_output(server, reference):
    async def main():
        client = server.openai()
        whole = await client.chat.completions.create(model="eyes", max_tokens=TOKENS, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                         {"type": "text", "text": PROMPT}]}])
        streamed = [c async for c in await client.chat.completions.create(
            model="eyes", max_tokens=TOKENS, temperature=0, stream=True, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                             {"type": "text", "text": PROMPT}]}])]
        return whole, "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)

    whole, streamed = server.run(main(), timeout=300)
    text, count = reference
    assert same_text(whole.choices[0].message.content, text), (whole.choices[0].message.content, text)
    assert whole.usage.completion_tokens == count
    assert streamed == whole.choices[0].message.content


def test_vision_openai_sdk_responses_input_image_is_the_same(server, reference):
    async def main():
        return await server.openai().responses.create(model="eyes", max_output_tokens=TOKENS, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PICTURE), "detail": "auto"},
                                         {"type": "input_text", "text": PROMPT}]}])

    reply = server.run(main(), timeout=300)
    assert same_text(reply.output_text, reference[0]) and reply.usage.output_tokens == reference[1]


def test_vision_anthropic_sdk_image_block_is_the_same(server, reference):
    async def main():
        return await server.anthropic().messages.create(model="eyes", max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(PICTURE)}},
                {"type": "text", "text": PROMPT}]}])

    reply = server.run(main(), timeout=300)
    text = "".join(block.text for block in reply.content if block.type == "text")
    assert same_text(text, reference[0]) and reply.usage.output_tokens == reference[1]


def test_vision_ollama_client_images_is_the_same(server, reference, tmp_path):
    import ollama

    picture = tmp_path / "picture.png"
    picture.write_bytes(PICTURE)

    async def main():
        client = ollama.AsyncClient(host=server.url())
        chat = await client.chat(model="eyes", options={"temperature": 0, "num_predict": TOKENS}, messages=[
            {"role": "user", "content": PROMPT, "images": [str(picture)]}])  # the client sends base64
        generated = await client.generate(model="eyes", prompt=PROMPT, images=[PICTURE],
                                          options={"temperature": 0, "num_predict": TOKENS})
        return chat, generated

    chat, generated = server.run(main(), timeout=300)
    assert same_text(chat.message.content, reference[0]) and chat.eval_count == reference[1]
    assert generated.response == chat.message.content


def test_vision_a_second_turn_with_the_same_image_reports_cached_tokens(server):
    """H1 through the server: the follow-up's usage says its image tokens came from the cache."""
    turn = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                        {"type": "text", "text": PROMPT}]}

    async def main():
        client = server.openai()
        first = await client.chat.completions.create(model="eyes", max_tokens=4, temperature=0, messages=[turn])
        follow = await client.chat.completions.create(model="eyes", max_tokens=4, temperature=0, messages=[
            turn, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"}])
        return first, follow

    first, follow = server.run(main(), timeout=300)
    assert follow.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
