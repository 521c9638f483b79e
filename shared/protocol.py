"""The wire protocol between the supervisor, its workers and outside clients.

Every message is a msgspec Struct, tagged by a `type` field and carrying the
protocol version `v`. There is one union per direction and socket, so each
socket has exactly one decoder and a peer can never slip a message of the
wrong direction in. Each direction has its module under shared/messages/;
this one names every message (`from shared import protocol as p`, then
`p.Generate`) and holds what decodes them at the edge:

  worker DEALER  -> supervisor ROUTER   WorkerReply   (hello, acks, token streams)    messages/replies.py
  supervisor ROUTER -> worker DEALER    Command       (limits, reclaim, abort, generate ...)
                                        and the WorkerSpec a worker starts with       messages/commands.py
  worker PUSH    -> supervisor PULL     WorkerReport  (samples, events)               messages/reports.py
  supervisor PUB -> any SUB             Published     (topic frame + message frame)   messages/published.py
  CLI DEALER     -> supervisor ROUTER   ControlRequest / ControlReply                 messages/control.py

Frames are msgpack. `Codec.decode` never raises on bad bytes: it returns a
`Malformed` explaining what was wrong (including a peer that speaks another
protocol version), so a socket loop can count it, log it once and go on.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages.commands import *  # noqa: F403
from shared.messages.commands import CommandMsg
from shared.messages.control import *  # noqa: F403
from shared.messages.control import ControlReply, ControlRequest
from shared.messages.envelope import *  # noqa: F403
from shared.messages.envelope import PROTOCOL_VERSION, Msg
from shared.messages.published import *  # noqa: F403
from shared.messages.published import Published
from shared.messages.replies import *  # noqa: F403
from shared.messages.replies import WorkerReply
from shared.messages.reports import *  # noqa: F403
from shared.messages.reports import WorkerReport
from shared.vocab import MalformedCause

# Largest frame any socket accepts; zmq enforces it with ZMQ_MAXMSGSIZE, so an
# oversized frame is dropped by the transport before it costs memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024
# Commands to a worker (supervisor -> worker only) may carry a request's images, which the
# front door bounds ([supervisor] max_images x max_image_bytes, at most MAX_IMAGE_PAYLOAD).
MAX_IMAGE_PAYLOAD = 64 * 1024 * 1024
MAX_COMMAND_BYTES = MAX_FRAME_BYTES + MAX_IMAGE_PAYLOAD

# --------------------------------------------------------------------------
# decoding at the edge


class Malformed(msgspec.Struct, frozen=True):
    """A frame that could not be taken: `cause` to count it by (never text the
    sender chose), `reason` one short line for the log."""

    cause: MalformedCause
    reason: str

    @property
    def wrong_version(self) -> bool:
        return self.cause == "wrong_version"


class _Peek(msgspec.Struct):
    v: int = -1
    type: str = ""


_peek = msgspec.msgpack.Decoder(_Peek)


class Codec:
    """One encoder and one decoder for one socket direction.

    `encode` returns fresh bytes on every call (never an `encode_into` buffer
    that a zero-copy send might still hold).
    """

    def __init__(self, union: Any, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)
        self.union = union
        self.max_bytes = max_bytes

    def encode(self, msg: Msg) -> bytes:
        return self._enc.encode(msg)

    def decode(self, frame: bytes) -> Any:
        """The message, or `Malformed` (never raises)."""
        if len(frame) > self.max_bytes:
            return Malformed("too_large", f"frame of {len(frame)} bytes exceeds {self.max_bytes}")
        try:
            msg = self._dec.decode(frame)
        except msgspec.DecodeError as exc:
            return _explain(frame, exc)
        if msg.v != PROTOCOL_VERSION:
            return Malformed("wrong_version", f"peer speaks protocol v{msg.v}, this side v{PROTOCOL_VERSION}")
        return msg


def _explain(frame: bytes, exc: Exception) -> Malformed:
    try:
        peek = _peek.decode(frame)
    except (msgspec.DecodeError, TypeError, ValueError):
        return Malformed("undecodable", f"undecodable frame ({len(frame)} bytes): {exc}")
    if peek.v not in (-1, PROTOCOL_VERSION):
        return Malformed("wrong_version", f"peer speaks protocol v{peek.v}, this side v{PROTOCOL_VERSION}")
    return Malformed("invalid_message", f"invalid {peek.type or 'untyped'} message: {exc}")


def all_message_types() -> dict[str, object]:
    """Every union on the wire, by name (for `python -m supervisor schema`)."""
    return {
        "WorkerReply": WorkerReply,
        "Command": CommandMsg,
        "WorkerReport": WorkerReport,
        "Published": Published,
        "ControlRequest": ControlRequest,
        "ControlReply": ControlReply,
    }
