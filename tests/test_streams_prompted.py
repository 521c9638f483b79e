"""A worker's `Prompted` is kept on its request's stream, never queued, and a
request that ends without one still releases whoever awaits the count."""

from __future__ import annotations

from shared import protocol as p
from supervisor.workers.streams import RequestStream, Streams


def test_prompted_is_held_on_the_stream_not_queued_with_the_tokens():
    stream = RequestStream("r", "m", "m#1")
    stream.put(p.Prompted(request_id="r", prompt_tokens=9, cached_tokens=4))
    stream.put(p.TokenOut(request_id="r", text="x"))
    assert stream.prompted == p.Prompted(request_id="r", prompt_tokens=9, cached_tokens=4)
    assert stream.prompt_known.is_set()
    assert stream.queue.qsize() == 1 and isinstance(stream.queue.get_nowait(), p.TokenOut)


def test_a_request_refused_before_its_prefill_releases_the_count_waiter():
    stream = RequestStream("r", "m", "m#1")
    assert not stream.prompt_known.is_set()
    stream.put(p.Failed(request_id="r", code="prefill_memory_exceeded", message="no"))
    assert stream.prompt_known.is_set() and stream.prompted is None


def test_the_streams_keep_the_one_map_of_requests_per_worker():
    """Who asks how many requests a worker runs asks the streams; a worker that
    exits ends each of its streams with the error, and only its own."""
    streams = Streams()
    a1, a2, b1 = streams.open("a#1", "a", "r1"), streams.open("a#1", "a", "r2"), streams.open("b#1", "b", "r3")
    assert (streams.running("a#1"), streams.running("b#1"), streams.running("c#1")) == (2, 1, 0)
    assert streams.deliver(p.Finished(request_id="r1", finish_reason="stop", prompt_tokens=1, completion_tokens=0)) is a1
    assert streams.running("a#1") == 1 and "r1" not in streams.by_id
    assert streams.deliver(p.TokenOut(request_id="r2", text="x")) is None  # not its end
    streams.fail_all("a#1", "worker_exited", "gone")
    assert streams.running("a#1") == 0 and a2.done and not b1.done
    assert isinstance(a2.queue.get_nowait(), p.TokenOut) and a2.queue.get_nowait().code == "worker_exited"
