"""A streamed reply's headers at once, and lines while it waits (supervisor/http/streaming.py), from
the client's end: raw HTTP, the openai, anthropic and ollama SDKs, against a real supervisor
whose worker loads slowly and steps slowly (the MEMVISOR_TEST_LOAD_DELAY and
MEMVISOR_TEST_STEP_DELAY switches: a load and a prefill of seconds on the tiny model).

Before, a streamed request sent no headers and no byte until its first token, so a proxy in
front (and Open WebUI behind it) could not tell a long load or prefill from a hung server: one
cut a request after 600 s with a 502.
"""

from __future__ import annotations

import json
import time

import httpx2  # what the openai and anthropic SDKs read through
import pytest

from supervisor.config import ModelConfig
from tests.http_harness import ADMIN_TOKEN, LiveServer, make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

LOAD_SECONDS = 3.0
STEP_SECONDS = 0.4
ASK = [{"role": "user", "content": "Say something"}]
LONG = "memory pressure makes the supervisor evict idle models " * 20  # ~350 tokens: several prefill chunks


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # the workers inherit the switches at spawn
        patch.setenv("MEMVISOR_TEST_LOAD_DELAY", str(LOAD_SECONDS))
        patch.setenv("MEMVISOR_TEST_STEP_DELAY", str(STEP_SECONDS))
        models = [ModelConfig(id="a", path=str(tiny_models.a))]
        config = make_config(models, http="127.0.0.1:0", admin_token=ADMIN_TOKEN, chunk_seconds=0.01)
        with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
            yield live


async def _unload(server) -> None:
    async with server.client() as c:
        r = await c.post("/v1/models/a/unload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 200, r.text


def test_headers_come_at_once_and_comments_tell_the_load_and_the_prefill_before_the_first_token(server):
    """Raw HTTP, as a proxy sees it: the headers within about a second although the model takes
    3 s to load, then `: loading ...` comment lines, then `: prefill N/T tokens` while a long
    prompt prefills, and only then the first `data:` event."""
    body = {"model": "a", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2, "stream": True,
            "temperature": 0}

    async def main():
        await _unload(server)
        async with server.client() as c:
            sent = time.monotonic()
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                headers_at = time.monotonic() - sent
                lines = []
                async for line in r.aiter_lines():
                    lines.append((time.monotonic() - sent, line))
        return r, headers_at, lines

    r, headers_at, lines = server.run(main(), timeout=300)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    first_data = next(at for at, line in lines if line.startswith("data: "))
    comments = [line for _, line in lines if line.startswith(": ")]
    assert headers_at < 2.5 < first_data, (headers_at, first_data)
    assert any(c.startswith(": loading") for c in comments), comments
    prefill = [c for c in comments if c.startswith(": prefill ") and c.endswith(" tokens")]
    assert prefill, comments
    done, total = prefill[-1].removeprefix(": prefill ").removesuffix(" tokens").split("/")
    assert 0 < int(done) < int(total)
    assert all(at < first_data for at, line in lines if line.startswith(": "))
    assert [line for _, line in lines if line][-1] == "data: [DONE]"


class Tee(httpx2.AsyncBaseTransport):
    """A transport that keeps every byte of the responses the SDK reads (the comments it skips too)."""

    def __init__(self) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.seen = bytearray()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        seen, upstream = self.seen, response.stream
        assert isinstance(upstream, httpx2.AsyncByteStream)

        class Copy(httpx2.AsyncByteStream):
            async def __aiter__(self):
                async for chunk in upstream:
                    seen.extend(chunk)
                    yield chunk

            async def aclose(self) -> None:
                await upstream.aclose()

        return httpx2.Response(response.status_code, headers=response.headers, stream=Copy(),
                              extensions=response.extensions)

    def take(self) -> bytes:
        out = bytes(self.seen)
        self.seen.clear()
        return out


def test_the_openai_and_anthropic_sdks_read_through_the_comments(server):
    """Each SDK's stream during a slow load held `: loading` comments (the bytes it read say so),
    parses, and its text is the non-streamed reply's."""
    kw = dict(model="a", max_tokens=4, temperature=0)
    an_kw = dict(model="a", max_tokens=4, extra_body={"temperature": 0})
    tee = Tee()
    read: list[bytes] = []

    async def main():
        http = httpx2.AsyncClient(transport=tee, timeout=120)
        oa, an = server.openai(http_client=http), server.anthropic(http_client=http)
        await _unload(server)
        chat = [c async for c in await oa.chat.completions.create(messages=ASK, stream=True, **kw)]
        read.append(tee.take())
        await _unload(server)
        text = [c async for c in await oa.completions.create(prompt=LONG, stream=True, **kw)]
        read.append(tee.take())
        await _unload(server)
        async with an.messages.stream(messages=ASK, **an_kw) as s:
            streamed = [e async for e in s]
            message = await s.get_final_message()
        read.append(tee.take())
        await _unload(server)
        events = [e async for e in await oa.responses.create(model="a", input="Say something", max_output_tokens=16,
                                                              temperature=0, stream=True)]
        read.append(tee.take())
        whole_chat = await oa.chat.completions.create(messages=ASK, **kw)
        whole_text = await oa.completions.create(prompt=LONG, **kw)
        whole_msg = await an.messages.create(messages=ASK, **an_kw)
        whole_resp = await oa.responses.create(model="a", input="Say something", max_output_tokens=16, temperature=0)
        return chat, text, streamed, message, events, whole_chat, whole_text, whole_msg, whole_resp

    chat, text, streamed, message, events, whole_chat, whole_text, whole_msg, whole_resp = server.run(main(), 600)
    for raw in read:  # each stream began with the load's comments, which the SDK skipped
        assert raw.startswith(b": loading"), raw[:80]
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == whole_chat.choices[0].message.content
    assert "".join(c.choices[0].text for c in text if c.choices) == whole_text.choices[0].text
    assert streamed[0].type == "message_start" and message.content[0].text == whole_msg.content[0].text
    assert events[-1].type in ("response.completed", "response.incomplete")  # max_output_tokens may cut it
    assert events[-1].response.output_text == whole_resp.output_text


def test_ollama_streams_send_empty_chunks_while_loading_and_its_client_reads_them(server):
    """Ollama's clients parse every NDJSON line as JSON, so the line while it waits is an empty
    chunk (`done: false`, no text): the official client reads the stream as ever."""
    import ollama

    kw = dict(model="a", messages=ASK, options={"temperature": 0, "num_predict": 4})

    async def main():
        await _unload(server)
        async with server.client() as c:
            sent = time.monotonic()
            async with c.stream("POST", "/api/chat", json={**kw, "stream": True}) as r:
                headers_at = time.monotonic() - sent
                raw = [line async for line in r.aiter_lines()]
        await _unload(server)
        client = ollama.AsyncClient(host=server.url())
        parts = [part async for part in await client.chat(stream=True, **kw)]
        whole = await client.chat(**kw)
        return headers_at, raw, parts, whole

    headers_at, raw, parts, whole = server.run(main(), timeout=300)
    lines = [json.loads(line) for line in raw]
    assert headers_at < 2.5 and lines[0] == {**lines[0], "done": False, "message": {"role": "assistant", "content": ""}}
    assert lines[-1]["done"] is True
    assert "".join(p.message.content for p in parts) == whole.message.content and parts[-1].done


def test_a_refusal_after_the_headers_is_an_error_event_the_sdk_raises(server):
    """Past the first second the status is sent: a prompt over the model's context found by the
    worker after a slow load is the API's error event in the stream, which the SDK raises."""
    import openai

    async def main():
        await _unload(server)
        client = server.openai()
        with pytest.raises(openai.APIError) as err:
            async for _ in await client.completions.create(model="a", prompt=LONG * 14, max_tokens=4, stream=True):
                pass
        return err.value

    err = server.run(main(), timeout=300)
    assert "context" in str(err)
    assert not isinstance(err, openai.APIStatusError)  # an event in a 200 stream, not the response's status
