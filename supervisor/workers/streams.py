"""Routing a worker's replies to the request that waits for them.

Every generation in flight has one `RequestStream`: the worker's tokens and
its one terminal message (`Finished` or `Failed`; an embedding request's
`Embedded` or `Failed`) land in the stream's queue,
where the front door reads them. The router knows streams by request id and
by worker, so a worker that exits can end every stream it was serving with a
clear error, and no stream is ever left waiting for a reply that cannot come.

A worker's `Prompted` (the prompt's final length) does not go into the queue: it is kept on the
stream, where a front door that needs the prompt's length early reads it (it
always arrives before the first token) or awaits it (`prompt_known`). So are the
latest `PrefillProgress` (what a streamed reply shows its client while a long
prompt prefills) and an echo's `Echoed` (the prompt as the model read it, which
comes before the first token and the end).

A tokenizer call (`Tokenize`, `Detokenize`) is no stream: it waits for its one
reply (`expect`), and it does not count as a request the worker runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Union

import msgspec

from shared import protocol as p
from shared.vocab import FailureCode

StreamReply = Union[p.TokenOut, p.Finished, p.Failed]
# An embedding request's stream gets one message, its vectors or its error.
EmbedReply = Union[p.Embedded, p.Failed]
# What a stream keeps instead of queueing: facts about the request a front door reads when it needs them.
Kept = Union[p.Prompted, p.PrefillProgress, p.Echoed]


def new_request_id() -> str:
    """The id of a request, made here only: the supervisor gives one to each request
    a door hands it without one (the doors build their response ids from it)."""
    return uuid.uuid4().hex


class RequestStream:
    """One generation in flight: replies from the worker land in `queue`."""

    __slots__ = ("request_id", "model_id", "worker_id", "queue", "created", "first_token", "done", "prompted",
                 "prompt_known", "progress", "echoed")

    def __init__(self, request_id: str, model_id: str, worker_id: str) -> None:
        self.request_id = request_id
        self.model_id = model_id
        self.worker_id = worker_id  # the worker serving it (X-Memvisor-Worker)
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.created = time.monotonic()
        self.first_token: float | None = None
        self.done = False
        self.prompted: p.Prompted | None = None  # the prompt's length, once the worker says
        self.prompt_known = asyncio.Event()  # set by Prompted, or by the end of a request that had none
        self.progress: p.PrefillProgress | None = None  # the latest, while a long prompt prefills
        self.echoed: p.Echoed | None = None  # an echo's prompt, before its first token

    def put(self, msg: StreamReply | Kept | p.Embedded) -> None:
        if self.done:
            return
        if isinstance(msg, p.PrefillProgress):
            self.progress = msg
            return
        if isinstance(msg, p.Echoed):
            self.echoed = msg
            return
        if isinstance(msg, p.Prompted):
            self.prompted = msg
            self.prompt_known.set()
            return
        self.prompt_known.set()  # a token or the end: no Prompted is coming after it
        if isinstance(msg, p.TokenOut) and self.first_token is None:
            self.first_token = time.monotonic()
        if isinstance(msg, (p.Finished, p.Failed, p.Embedded)):
            self.done = True
        self.queue.put_nowait(msg)


class Streams:
    """The open streams: the one map of requests in flight, by request id and by worker.

    Everyone who asks how many requests a worker runs (the policy's snapshot,
    the admission gate, readiness, the metrics) asks here."""

    def __init__(self) -> None:
        self.by_id: dict[str, RequestStream] = {}
        self._by_worker: dict[str, dict[str, RequestStream]] = {}
        self._calls: dict[str, tuple[str, asyncio.Future[p.TokensReply]]] = {}  # request id -> (worker, its reply)
        self.batches = 0  # TokenBatch frames delivered (a worker decoding in batches)
        # per model: (guessed tokens checked, accepted) over every finished request (speculative decoding)
        self.guesses: dict[str, tuple[int, int]] = {}

    def open(self, worker_id: str, model_id: str, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, model_id, worker_id)
        self.by_id[request_id] = stream
        self._by_worker.setdefault(worker_id, {})[request_id] = stream
        return stream

    def running(self, worker_id: str) -> int:
        """Requests the worker serves now (opened and not yet ended)."""
        return len(self._by_worker.get(worker_id, ()))

    def deliver(self, msg: StreamReply | Kept | p.Embedded) -> RequestStream | None:
        """A worker's reply for one request; a reply for a forgotten request is dropped.
        Returns the stream when this reply ended it."""
        stream = self.by_id.get(msg.request_id)
        if stream is not None:
            stream.put(msg)
            if isinstance(msg, p.Finished) and msg.proposed_tokens:
                proposed, accepted = self.guesses.get(stream.model_id, (0, 0))
                self.guesses[stream.model_id] = (proposed + msg.proposed_tokens, accepted + msg.accepted_tokens)
            if stream.done:
                self.close(stream)
                return stream
        return None

    def deliver_batch(self, msg: p.TokenBatch) -> None:
        """A batched decode step's tokens, one per request, from one frame."""
        self.batches += 1
        by_id = self.by_id
        if msg.logprobs is not msgspec.UNSET:  # some row asked for logprobs
            for token in msg.tokens():
                stream = by_id.get(token.request_id)
                if stream is not None:
                    stream.put(token)
            return
        for rid, text, token_id in zip(msg.request_ids, msg.texts, msg.token_ids):
            stream = by_id.get(rid)
            if stream is not None:
                stream.put(p.TokenOut(request_id=rid, text=text, token_id=token_id))

    def close(self, stream: RequestStream) -> None:
        self.by_id.pop(stream.request_id, None)
        mine = self._by_worker.get(stream.worker_id)
        if mine is not None:
            mine.pop(stream.request_id, None)
            if not mine:
                del self._by_worker[stream.worker_id]

    def fail_all(self, worker_id: str, code: FailureCode, message: str) -> None:
        """The worker is gone: every request it served ends with this error."""
        for stream in list(self._by_worker.get(worker_id, {}).values()):
            stream.put(p.Failed(request_id=stream.request_id, code=code, message=message))
            self.close(stream)

    # -- calls: one command, one reply ----------------------------------------------

    def expect(self, worker_id: str, request_id: str) -> asyncio.Future[p.TokensReply]:
        """The reply the worker will send to the call `request_id`."""
        waiter: asyncio.Future[p.TokensReply] = asyncio.get_running_loop().create_future()
        self._calls[request_id] = (worker_id, waiter)
        return waiter

    def awaits(self, request_id: str) -> bool:
        return request_id in self._calls

    def answer(self, msg: p.TokensReply) -> None:
        entry = self._calls.pop(msg.request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(msg)

    def forget_call(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    def fail_calls(self, worker_id: str, error: Exception) -> None:
        """The worker is gone: every call it had not answered fails with `error`."""
        for request_id, (owner, waiter) in list(self._calls.items()):
            if owner == worker_id:
                if not waiter.done():
                    waiter.set_exception(error)
                del self._calls[request_id]
