"""Routing a worker's replies to the request that waits for them.

Every generation in flight has one `RequestStream`: the worker's tokens and
its one terminal message (`Finished` or `Failed`; an embedding request's
`Embedded` or `Failed`) land in the stream's queue,
where the front door reads them. The router knows streams by request id and
by worker, so a worker that exits can end every stream it was serving with a
clear error, and no stream is ever left waiting for a reply that cannot come.

A worker's `Prompted` (issue 23) does not go into the queue: it is kept on the
stream, where a front door that needs the prompt's length early reads it (it
always arrives before the first token) or awaits it (`prompt_known`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Union

import msgspec

from shared import protocol as p
from shared.vocab import FailureCode

if TYPE_CHECKING:
    from supervisor.pool import WorkerHandle

StreamReply = Union[p.TokenOut, p.Finished, p.Failed]
# An embedding request's stream gets one message, its vectors or its error.
EmbedReply = Union[p.Embedded, p.Failed]


class RequestStream:
    """One generation in flight: replies from the worker land in `queue`."""

    __slots__ = ("request_id", "model_id", "worker", "queue", "created", "first_token", "done", "prompted",
                 "prompt_known")

    def __init__(self, request_id: str, model_id: str, worker: WorkerHandle) -> None:
        self.request_id = request_id
        self.model_id = model_id
        self.worker = worker
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.created = time.monotonic()
        self.first_token: float | None = None
        self.done = False
        self.prompted: p.Prompted | None = None  # issue 23: the prompt's length, once the worker says
        self.prompt_known = asyncio.Event()  # set by Prompted, or by the end of a request that had none

    def put(self, msg: StreamReply | p.Prompted | p.Embedded) -> None:
        if self.done:
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
    """The open streams, by request id; each worker handle keeps its own too."""

    def __init__(self) -> None:
        self.by_id: dict[str, RequestStream] = {}
        self.batches = 0  # issue 11: TokenBatch frames delivered (a worker decoding in batches)

    def open(self, handle: WorkerHandle, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, handle.model_id, handle)
        self.by_id[request_id] = stream
        handle.requests[request_id] = stream
        handle.last_access = time.monotonic()
        return stream

    def deliver(self, msg: StreamReply | p.Prompted | p.Embedded) -> None:
        """A worker's reply for one request; a reply for a forgotten request is dropped."""
        stream = self.by_id.get(msg.request_id)
        if stream is not None:
            stream.put(msg)
            if stream.done:
                self.close(stream)

    def deliver_batch(self, msg: p.TokenBatch) -> None:
        """Issue 11: a batched decode step's tokens, one per request, from one frame."""
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
        stream.worker.requests.pop(stream.request_id, None)
        stream.worker.last_access = time.monotonic()

    def fail_all(self, handle: WorkerHandle, code: FailureCode, message: str) -> None:
        """The worker is gone: every request it served ends with this error."""
        for stream in list(handle.requests.values()):
            stream.put(p.Failed(request_id=stream.request_id, code=code, message=message))
            self.close(stream)
