"""Images on every API's front door, refused clearly (docs/vision.md): a real supervisor and its HTTP
front door; every request here is refused before a model loads, with a 4xx naming the field."""

from __future__ import annotations

import pytest

from supervisor.config import ModelConfig
from tests.http_harness import LiveServer, make_config
from tests.image_harness import b64, data_url, image_bytes

MAX_BODY = 16 * 1024
SMALL = image_bytes(48, 32, seed=1)          # 1,536 pixels
BIG_PIXELS = image_bytes(160, 160, seed=2, flat=True)   # 25,600 pixels (over the cap below) in few bytes
WIDE = image_bytes(120, 100, fmt="PNG", seed=3)  # under the pixel and byte caps, over max_body as base64


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_vlm, tiny_model):
    models = [ModelConfig(id="vlm", path=str(tiny_vlm)), ModelConfig(id="text", path=str(tiny_model))]
    config = make_config(models, max_body=MAX_BODY, max_images=2, max_image_bytes="40KiB", max_image_pixels=20_000)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        yield live


def post(server, path: str, body: dict):
    async def main():
        async with server.client() as c:
            return await c.post(path, json=body)

    return server.run(main())


def chat(server, parts: list, model: str = "vlm"):
    return post(server, "/v1/chat/completions",
                {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": parts}]})


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(response, status: int = 400, code: str = "invalid_image") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


CHAT_FIELD = "messages[0].content[1].image_url.url"


@pytest.mark.parametrize("url, words", [
    (data_url(image_bytes(64, 64, seed=4)[:300]), "PNG file could not be decoded"),
    (data_url(b"plain words, no image at all"), "not an image"),
    (data_url(image_bytes(40, 30, fmt="BMP")), "unsupported image format BMP"),
    (data_url(image_bytes(40, 30, fmt="TIFF")), "unsupported image format TIFF"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    ("file:///etc/passwd", "data: URL or an http(s) URL"),
    ("http://127.0.0.1:9/cat.png", "not fetched on this server"),
    (data_url(BIG_PIXELS), "160x160 pixels, over the 20000"),
    (data_url(image_bytes(150, 120, fmt="PNG", seed=9)), "over the 40 KiB"),
])
def test_a_bad_chat_image_url_is_a_400_naming_its_field(server, url, words):
    error = refused(chat(server, [{"type": "text", "text": "What?"}, image_part(url)]))
    assert error["param"] == CHAT_FIELD and words in error["message"], error


def test_too_many_images_name_the_first_over_the_cap(server):
    parts = [image_part(data_url(SMALL))] * 3
    error = refused(chat(server, parts))
    assert error["param"] == "messages[0].content[2].image_url.url" and "at most 2 images" in error["message"]


def test_an_image_for_a_text_model_is_model_lacks_vision_not_a_silent_drop(server):
    error = refused(chat(server, [image_part(data_url(SMALL)), {"type": "text", "text": "What?"}], model="text"),
                    code="model_lacks_vision")
    assert error["param"] == "messages[0].content[0].image_url.url" and "reads only text" in error["message"]


def test_an_image_route_reads_past_max_body_by_its_images_and_no_further(server):
    """The images' base64 does not count against max_body; the rest of the body still does (413)."""
    assert len(data_url(WIDE)) > MAX_BODY
    # refused for the model, not for its size: the body was read and its image checked
    refused(chat(server, [image_part(data_url(WIDE)), {"type": "text", "text": "What?"}], model="text"),
            code="model_lacks_vision")
    words = chat(server, [{"type": "text", "text": "x" * (MAX_BODY + 10)}], model="text")
    assert words.status_code == 413 and words.json()["error"]["code"] == "request_too_large"


def test_responses_input_image(server):
    body = {"model": "vlm", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": data_url(b"not an image")}]}]}
    error = refused(post(server, "/v1/responses", body))
    assert error["param"] == "input[0].content[1].image_url" and "not an image" in error["message"]
    body["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-123"}
    error = refused(post(server, "/v1/responses", body))
    assert error["param"] == "input[0].content[1].file_id" and "no files API" in error["message"]


def test_anthropic_image_blocks(server):
    def ask(source: dict):
        return post(server, "/v1/messages", {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "What?"}]}]})

    response = ask({"type": "base64", "media_type": "image/png", "data": b64(b"not an image")})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "not an image" in error["message"] and "messages[0].content[0].source.data" in error["message"]
    response = ask({"type": "file", "file_id": "f"})
    assert response.status_code == 400 and "messages[0].content[0].source" in response.json()["error"]["message"]
    response = ask({"type": "base64", "media_type": "image/png", "data": b64(BIG_PIXELS)})
    assert response.status_code == 400 and "max_image_pixels" in response.json()["error"]["message"]


def test_ollama_images_on_chat_and_generate(server):
    response = post(server, "/api/chat", {"model": "vlm", "stream": False, "messages": [
        {"role": "user", "content": "What?", "images": [b64(SMALL), b64(image_bytes(30, 30, fmt="BMP"))]}]})
    assert response.status_code == 400
    assert "messages[0].images[1]" in response.json()["error"] and "BMP" in response.json()["error"]
    response = post(server, "/api/generate", {"model": "vlm", "stream": False, "prompt": "What?",
                                              "images": ["%%%"]})
    assert response.status_code == 400 and "images[0]: not valid base64" in response.json()["error"]
    response = post(server, "/api/generate", {"model": "vlm", "stream": False, "prompt": "What?", "raw": True,
                                              "images": [b64(SMALL)]})
    assert response.status_code == 400 and "raw" in response.json()["error"]
    response = post(server, "/api/generate", {"model": "text", "stream": False, "prompt": "What?",
                                              "images": [b64(SMALL)]})
    assert response.status_code == 400 and "reads only text" in response.json()["error"]


def test_the_cards_say_vision_where_the_model_reads_images(server):
    async def main():
        async with server.client() as c:
            cards = (await c.get("/v1/models")).json()["data"]
            tags = (await c.get("/api/tags")).json()["models"]
            shows = {m: (await c.post("/api/show", json={"model": m})).json() for m in ("vlm", "text")}
        return cards, tags, shows

    cards, tags, shows = server.run(main())
    caps = {card["id"]: card["capabilities"] for card in cards}
    assert "vision" in caps["vlm"] and "vision" not in caps["text"]
    assert "vision" in shows["vlm"]["capabilities"] and "vision" not in shows["text"]["capabilities"]
    tag_caps = {t["name"].split(":")[0]: t.get("capabilities", []) for t in tags}
    assert "vision" in tag_caps["vlm"] and "vision" not in tag_caps["text"]


def test_with_fetching_on_a_url_to_a_private_address_is_still_refused(tmp_path_factory, tiny_vlm):
    """fetch_image_urls = true fetches public URLs only: loopback (here) and private networks never."""
    config = make_config([ModelConfig(id="vlm", path=str(tiny_vlm))], fetch_image_urls=True)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        error = refused(chat(live, [{"type": "text", "text": "What?"}, image_part("http://127.0.0.1:9/cat.png")]))
    assert error["param"] == CHAT_FIELD and "non-public address (127.0.0.1)" in error["message"]
