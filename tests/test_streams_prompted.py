"""Issue 23: a worker's `Prompted` is kept on its request's stream, never queued, and a
request that ends without one still releases whoever awaits the count."""

from __future__ import annotations

from shared import protocol as p
from supervisor.streams import RequestStream


def test_prompted_is_held_on_the_stream_not_queued_with_the_tokens():
    stream = RequestStream("r", "m", worker=None)  # type: ignore[arg-type]
    stream.put(p.Prompted(request_id="r", prompt_tokens=9, cached_tokens=4))
    stream.put(p.TokenOut(request_id="r", text="x"))
    assert stream.prompted == p.Prompted(request_id="r", prompt_tokens=9, cached_tokens=4)
    assert stream.prompt_known.is_set()
    assert stream.queue.qsize() == 1 and isinstance(stream.queue.get_nowait(), p.TokenOut)


def test_a_request_refused_before_its_prefill_releases_the_count_waiter():
    stream = RequestStream("r", "m", worker=None)  # type: ignore[arg-type]
    assert not stream.prompt_known.is_set()
    stream.put(p.Failed(request_id="r", code="prefill_memory_exceeded", message="no"))
    assert stream.prompt_known.is_set() and stream.prompted is None
