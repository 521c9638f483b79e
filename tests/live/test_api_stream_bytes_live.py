"""A plain streamed reply's own loop sends the very bytes of the general path (supervisor/http/generate.py).

`Completion.sse` renders a reply with no tools, no logprobs, no constraint and no echo in one
loop (`_plain_sse`) instead of through `Job.pieces`, `Completion.chunks` and `Job.sse_body`:
the same greedy request, through a real supervisor and a real worker, is streamed once each
way and the SSE bodies must match byte for byte (the request's id and creation time aside:
they are each request's own). A client that leaves mid-stream and a worker killed mid-stream
come out the same either way too: the request is cancelled in the worker and counted once; the
error event and `[DONE]` follow the tokens that came. A request that is not plain (logprobs,
tools) keeps the general path.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import pytest

from supervisor.http.generate import Completion
from tests.http_harness import metric, until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

CHAT = [{"role": "user", "content": "Tell me about the sea."}]
_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')
_WAITING = re.compile(rb"^: [^\n]*\n\n", re.MULTILINE)  # `: loading ...` while the model loads


def _own_fields_out(body: bytes) -> bytes:
    """The reply's events, each request's id and creation time replaced by a placeholder."""
    return _CREATED.sub(b'"created":0', _ID.sub(rb'"id":"\1-X"', _WAITING.sub(b"", body)))


class PlainCalls:
    """Counts the replies rendered by the plain loop (the spy on `Completion._plain_sse`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = Completion._plain_sse

        def counted(reply: Completion, first):
            self.count += 1
            return real(reply, first)

        monkeypatch.setattr(Completion, "_plain_sse", counted)


async def _body(server, path: str, body: dict) -> bytes:
    async with server.client() as c:
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            return await r.aread()


def _both_ways(server, monkeypatch, path: str, body: dict) -> tuple[bytes, bytes, int]:
    """The body through the plain loop, then through the general path; how many plain renders."""
    spy = PlainCalls(monkeypatch)
    fast = server.run(_body(server, path, body))
    used = spy.count
    with monkeypatch.context() as general:
        general.setattr(Completion, "plain", property(lambda self: False))
        slow = server.run(_body(server, path, body))
    assert spy.count == used, "the general path went through the plain loop"
    return fast, slow, used


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 40}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 40, "stream_options": {"include_usage": True},
                              "stop": ["e"]}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40,
                         "stream_options": {"include_usage": True}}),
], ids=["chat", "chat-usage-stop", "text", "text-usage"])
def test_plain_stream_is_byte_identical_to_the_general_path(server, monkeypatch, path, body):
    """Chat and text completions, with and without the usage chunk and a stop string: the
    plain loop renders them (the spy counts it) and its bytes are the general path's."""
    fast, slow, used = _both_ways(server, monkeypatch, path, {"model": "a", "stream": True, "temperature": 0,
                                                              **body})
    assert used == 1
    assert fast.endswith(b"data: [DONE]\n\n") and fast.count(b"data: ") > 3, fast
    assert _own_fields_out(fast) == _own_fields_out(slow), (fast[:400], slow[:400])


@pytest.mark.parametrize("extra", [
    {"logprobs": True, "top_logprobs": 2},
    {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
], ids=["logprobs", "tools"])
def test_a_reply_with_more_than_text_keeps_the_general_path(server, monkeypatch, extra):
    """Logprobs ride with the text and tool calls are looked for in it: the plain loop renders neither."""
    spy = PlainCalls(monkeypatch)
    body = {"model": "a", "stream": True, "temperature": 0, "messages": CHAT, "max_tokens": 8, **extra}
    got = server.run(_body(server, "/v1/chat/completions", body))
    assert got.endswith(b"data: [DONE]\n\n")
    assert spy.count == 0


LONG = 3_900  # tokens (the tiny model's context is 4,096): seconds of generation, cut long before
STREAM = {"model": "a", "stream": True, "temperature": 0, "messages": CHAT, "max_tokens": LONG}
_ERROR = re.compile(rb'data: \{"error":[^\n]*\n\n')


def _general(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Completion, "plain", property(lambda self: False))


def _tokens_of(body: bytes) -> list[bytes]:
    """The body's token chunks (each its own event), own fields out: the text they carry."""
    return [e for e in _own_fields_out(body).split(b"\n\n") if b'"content":"' in e and b'"role"' not in e]


async def _left_after(server, chunks: int) -> tuple[bytes, float, float]:
    """A client that reads `chunks` events and leaves; what it read, and the cancellations counted
    and the worker's token count once the worker stopped generating."""
    arb = server.arbiter
    async with server.client() as c:
        before = metric((await c.get("/metrics")).text, "memvisor_generations_total", model="a", outcome="cancelled")
        read = b""
        async with c.stream("POST", "/v1/chat/completions", json=STREAM) as r:
            assert r.status_code == 200, await r.aread()
            worker = arb.pool.worker_for("a")
            async for line in r.aiter_bytes():
                read += line
                if read.count(b"data: ") > chunks:
                    break
        await until(lambda: not arb.pool.running(worker), timeout=10, what="the stream forgotten")
        await until(lambda: worker.sample is not None and worker.sample.running == 0, timeout=10,
                    what="the worker running nothing")
        after = metric((await c.get("/metrics")).text, "memvisor_generations_total", model="a", outcome="cancelled")
    return read, after - before, worker.sample.tokens


def test_a_client_leaving_mid_stream_cancels_the_request_either_way(server, monkeypatch):
    """The plain loop ends the request in the worker when its client leaves, as the general
    path does: the worker stops generating, one cancellation is counted, and what the client
    read is the reply's first tokens."""
    spy = PlainCalls(monkeypatch)
    fast, fast_cancelled, _ = server.run(_left_after(server, 20))
    assert spy.count == 1
    with monkeypatch.context() as general:
        _general(general)
        slow, slow_cancelled, _ = server.run(_left_after(server, 20))
    assert spy.count == 1
    assert fast_cancelled == slow_cancelled == 1
    shorter = min(len(_tokens_of(fast)), len(_tokens_of(slow)))
    assert shorter >= 19 and _tokens_of(fast)[:shorter] == _tokens_of(slow)[:shorter]


async def _killed_after(server, chunks: int) -> bytes:
    """A stream whose worker is SIGKILLed once `chunks` events came: the whole body."""
    body = b""
    async with server.client() as c:
        async with c.stream("POST", "/v1/chat/completions", json=STREAM) as r:
            assert r.status_code == 200, await r.aread()
            worker = server.arbiter.pool.worker_for("a")
            async for part in r.aiter_bytes():
                if body.count(b"data: ") <= chunks < (body + part).count(b"data: "):
                    os.kill(worker.pid, signal.SIGKILL)
                body += part
    await until(lambda: (w := server.arbiter.pool.worker_for("a")) is None or w is not worker,
                what="the killed worker forgotten")
    await asyncio.sleep(0)
    return body


def test_a_worker_killed_mid_stream_ends_with_the_same_error_event_either_way(server, monkeypatch):
    """The worker's failure ends the plain loop's body as it ends the general path's: the
    tokens so far, the error event (worker_exited), then `[DONE]`."""
    spy = PlainCalls(monkeypatch)
    fast = server.run(_killed_after(server, 10))
    assert spy.count == 1
    with monkeypatch.context() as general:
        _general(general)
        slow = server.run(_killed_after(server, 10))
    assert spy.count == 1
    for body in (fast, slow):
        assert body.endswith(b"\n\ndata: [DONE]\n\n") and b'"code":"worker_exited"' in body, body[-400:]
    digits = re.compile(rb"\d+")
    fast_error, slow_error = (digits.sub(b"N", _ERROR.findall(b)[-1]) for b in (fast, slow))
    assert fast_error == slow_error
    shorter = min(len(_tokens_of(fast)), len(_tokens_of(slow)))
    assert shorter >= 10 and _tokens_of(fast)[:shorter] == _tokens_of(slow)[:shorter]
    for body in (fast, slow):  # the error event is the body's last before [DONE], no finish chunk
        events = _own_fields_out(body).split(b"\n\n")
        assert events[-3].startswith(b'data: {"error":') and b'"finish_reason":"' not in body
