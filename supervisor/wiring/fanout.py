"""In-process fan-out of the PUB topics, for doors that are not ZeroMQ clients.

`GET /v1/events` (Server-Sent Events) needs every message the PUB socket
carries, inside the supervisor's own loop. The bus hands each published
message to `Hub.publish` beside its socket send; the hub stamps it with a
sequence id and the wall time, keeps a bounded history, and appends it to the
queue of every subscriber that wants its topic.

Why it is built this way:
- **The guard never waits for a client.** `publish` runs in the enforcer's
  call stack, so it only appends to deques (clients are woken once per loop
  pass, after the guard's callback returns): no await, no write. A client whose queue is full is dropped on the spot (its queue is
  cleared and replaced by one final `dropped` frame), so one slow browser
  costs at most its bounded queue, and 50 of them cost 50 appends a message.
- **JSON once per message, not once per client.** A `Frame` encodes lazily
  and caches the bytes; every queue holds the same Frame. With nobody
  subscribed nothing is encoded at all.
- **History for replay.** The guard's events (SPEC S2) are kept as long as
  the event log keeps its own history; other topics for a few minutes, so a
  dashboard opened now can draw the last minutes (`since`), and an
  EventSource that reconnects resumes after the last id it saw.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Iterable

import msgspec

from shared import protocol as p

QUEUE_MAX = 512          # frames a client may lag behind before it is dropped
EVENT_HISTORY = 500      # guard events kept for replay (the event log keeps as many for status)
RECENT_HISTORY = 6000    # other frames kept for replay: minutes of samples for a few workers
REPLAY_CHUNK = 512       # replayed frames written at once
WAKE_DELAY = 0.05        # clients are woken at most this often (20 Hz): bursts become one write each
WAKE_BATCH = 8           # clients woken per loop pass: the guard waits behind at most this many writes


class StatusJson(msgspec.Struct, tag="status", tag_field="type", kw_only=True):
    """StatusMsg with its S1 payload inline as JSON (msgpack carries it as bytes)."""

    v: int
    t: float
    status: msgspec.Raw


class EndNotice(msgspec.Struct, kw_only=True):
    """The last frame of a stream the server ends: why, and the newest id then."""

    reason: str
    last_id: int = 0


_json = msgspec.json.Encoder()


def encode_json(msg: p.Msg) -> bytes:
    """A published message as JSON, the same fields as on PUB (`type` tags it)."""
    if isinstance(msg, p.StatusMsg):
        return _json.encode(StatusJson(v=msg.v, t=msg.t, status=msgspec.Raw(msg.status)))
    return _json.encode(msg)


class Frame:
    """One published message: id, topic, wall time, and its JSON made at most once."""

    __slots__ = ("id", "topic", "wall", "msg", "_data")

    def __init__(self, frame_id: int, topic: str, wall: float, msg: p.Msg | None, data: bytes | None = None) -> None:
        self.id = frame_id
        self.topic = topic
        self.wall = wall
        self.msg = msg
        self._data = data

    @property
    def data(self) -> bytes:
        if self._data is None:
            assert self.msg is not None
            self._data = encode_json(self.msg)
        return self._data


class Subscription:
    """One client's bounded queue, fed by the hub, drained by its door."""

    def __init__(self, hub: Hub, topics: frozenset[str], queue_max: int) -> None:
        self.hub = hub
        self.topics = topics
        self.queue_max = queue_max
        self.queue: collections.deque[Frame] = collections.deque()   # live frames: bounded by queue_max
        self.backlog: collections.deque[Frame] = collections.deque()  # the replay: history's own frames
        self.ended = False
        self.end_reason = ""
        self._ready = asyncio.Event()

    def overflow(self, frame: Frame) -> None:
        """The live queue is full: drop this client (the hub calls this instead of appending)."""
        if not self.ended:
            self.hub.dropped += 1
            self.end(f"this client fell {self.queue_max} messages behind and was dropped "
                     "(reconnect with Last-Event-ID to resume from the history)", topic="dropped", last_id=frame.id)

    def end(self, reason: str, *, topic: str = "closed", last_id: int = 0) -> None:
        """Stop queueing; the client gets one final `dropped`/`closed` frame, then the end."""
        if self.ended:
            return
        self.ended = True
        self.end_reason = reason
        self.queue.clear()
        self.backlog.clear()
        notice = _json.encode(EndNotice(reason=reason, last_id=last_id or self.hub.next_id - 1))
        self.queue.append(Frame(0, topic, time.time(), None, notice))
        self.hub.forget(self)
        self._ready.set()

    async def get(self, timeout: float) -> list[Frame] | None:
        """Every frame waiting (at once, so a lagging client gets one write, not
        many); [] when `timeout` passed with none; None once the stream is over."""
        if self.backlog:
            frames = [self.backlog.popleft() for _ in range(min(REPLAY_CHUNK, len(self.backlog)))]
            if not self.backlog:
                frames += self.queue
                self.queue.clear()
            return frames
        if not self.queue:
            if self.ended:
                return None
            self._ready.clear()
            timer = asyncio.get_running_loop().call_later(timeout, self._ready.set)
            try:
                await self._ready.wait()
            finally:
                timer.cancel()
        if not self.queue and self.ended:
            return None
        frames = list(self.queue)
        self.queue.clear()
        return frames

    def close(self) -> None:
        """The client left: forget it without a final frame."""
        self.ended = True
        self.queue.clear()
        self.backlog.clear()
        self.hub.forget(self)
        self._ready.set()


class Hub:
    def __init__(self, *, queue_max: int = QUEUE_MAX, event_history: int = EVENT_HISTORY,
                 recent_history: int = RECENT_HISTORY, wake_delay: float = WAKE_DELAY) -> None:
        self.queue_max = queue_max
        self.wake_delay = wake_delay
        self.next_id = 1
        self.events: collections.deque[Frame] = collections.deque(maxlen=event_history)
        self.recent: collections.deque[Frame] = collections.deque(maxlen=recent_history)
        self.latest: dict[str, Frame] = {}
        self.subscribers: set[Subscription] = set()
        self._fanout: tuple[Subscription, ...] = ()   # the subscribers, as publish walks them
        self.dropped = 0      # clients dropped for lagging, since start
        self.closed = False
        self._wake_due = False

    def publish(self, msg: p.Msg) -> None:
        """Called for every PUB message, in the loop; O(subscribers) appends."""
        topic = p.TOPIC_OF[type(msg)]
        frame = Frame(self.next_id, topic, time.time(), msg)
        self.next_id += 1
        (self.events if topic == "event" else self.recent).append(frame)
        self.latest[topic] = frame
        if not self._fanout:
            return
        for sub in self._fanout:  # inlined: this loop is the guard's whole cost per client
            if topic in sub.topics:
                if len(sub.queue) < sub.queue_max:
                    sub.queue.append(frame)
                else:
                    sub.overflow(frame)
        if not self._wake_due:
            self._wake_due = True
            try:
                asyncio.get_running_loop().call_later(self.wake_delay, self._wake)
            except RuntimeError:  # no loop running (a test driving the hub by hand)
                self._wake()

    def _wake(self) -> None:
        """One wake-up per client for everything published in the last WAKE_DELAY.

        Not at once: the message that wakes the guard (a sample over a
        watermark) would otherwise wake every client in the same loop pass,
        and the guard's tick would wait behind their writes. A burst of
        samples costs each client one write, and the publisher none."""
        self._wake_due = False
        self._wake_some([sub for sub in self._fanout if sub.queue])

    def _wake_some(self, waiting: list[Subscription]) -> None:
        """WAKE_BATCH clients now, the rest in later passes of the loop: a guard
        tick that becomes due meanwhile runs between the batches."""
        for sub in waiting[:WAKE_BATCH]:
            sub._ready.set()
        if len(waiting) > WAKE_BATCH:
            try:
                asyncio.get_running_loop().call_soon(self._wake_some, waiting[WAKE_BATCH:])
            except RuntimeError:
                self._wake_some(waiting[WAKE_BATCH:])

    def subscribe(self, topics: Iterable[str], *, since: float | None = None, after_id: int | None = None,
                  queue_max: int | None = None) -> Subscription:
        """A new client's queue, primed with its replay:

        - `after_id` (an EventSource's Last-Event-ID): every kept frame after it;
        - else `since` (unix seconds): every kept frame stamped after it;
        - else the guard's event history and the latest ceiling, pressure and status.
        """
        sub = Subscription(self, frozenset(topics), queue_max or self.queue_max)
        if self.closed:
            sub.end("the supervisor is shutting down")
            return sub
        sub.backlog.extend(self.replay(sub.topics, since, after_id))
        self.subscribers.add(sub)
        self._fanout = tuple(self.subscribers)
        return sub

    def replay(self, topics: frozenset[str], since: float | None, after_id: int | None) -> list[Frame]:
        if after_id is not None and after_id >= self.next_id:
            after_id = 0  # an id from an earlier supervisor: everything kept is new to this client
        if after_id is not None:
            kept = [f for f in self._kept() if f.id > after_id]
        elif since is not None:
            kept = [f for f in self._kept() if f.wall > since]
        else:
            kept = list(self.events) + [f for t, f in self.latest.items() if t in ("ceiling", "pressure", "status")]
        return sorted((f for f in kept if f.topic in topics), key=lambda f: f.id)

    def _kept(self) -> list[Frame]:
        return list(self.events) + list(self.recent)

    def forget(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)
        self._fanout = tuple(self.subscribers)

    def close(self, reason: str) -> None:
        """Shutdown: every stream ends with a final frame, so the HTTP server can stop."""
        self.closed = True
        for sub in list(self.subscribers):
            sub.end(reason)
