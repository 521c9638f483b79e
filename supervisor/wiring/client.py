"""Talking to a running supervisor from outside: the control socket and PUB.

Used by the `status`, `load`, `unload`, `drill` and `watch` commands. A client
finds its supervisor through the runtime directory's endpoints.json; when none
runs there it gets `NotRunning` with a sentence saying so.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable, Iterator

import zmq

from shared import protocol as p
from supervisor.wiring.bus import Endpoints, NotRunning, pid_alive

__all__ = ["ControlClient", "NotRunning", "subscribe"]


class ControlClient:
    def __init__(self, runtime_dir: Path, timeout: float = 10.0) -> None:
        self.endpoints = Endpoints.load(runtime_dir)
        if not pid_alive(self.endpoints.pid):
            raise NotRunning(f"the supervisor that used {runtime_dir} (pid {self.endpoints.pid}) is gone")
        self.runtime_dir = runtime_dir
        self.timeout = timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.IDENTITY, f"cli-{uuid.uuid4().hex[:12]}".encode())
        self._sock.connect(self.endpoints.control)
        self._req = p.Codec(p.ControlRequest)
        self._rep = p.Codec(p.ControlReply)

    def call(self, request: p.Msg, timeout: float | None = None):
        """Send one request; return ControlOk or ControlError (never a Malformed)."""
        self._sock.send(self._req.encode(request))
        wait_ms = int(1000 * (self.timeout if timeout is None else timeout))
        if not self._sock.poll(wait_ms, zmq.POLLIN):
            raise NotRunning(
                f"the supervisor at {self.runtime_dir} did not answer within {wait_ms / 1000:.0f} s "
                f"(is it running? pid in endpoints.json: {self.endpoints.pid})"
            )
        reply = self._rep.decode(self._sock.recv())
        if isinstance(reply, p.Malformed):
            return p.ControlError(code="bad_reply", message=f"unreadable reply from the supervisor: {reply.reason}")
        return reply

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def subscribe(
    runtime_dir: Path,
    topics: list[str],
    timeout: float | None = None,
    *,
    endpoint: str = "",
    server_key: str = "",
    first: Callable[[], list[tuple[str, object]]] | None = None,
) -> Iterator[tuple[str, object]]:
    """Yield (topic, message) from the supervisor's PUB socket.

    By default the local supervisor of `runtime_dir`; `endpoint` names
    another (e.g. its opt-in TCP PUB), and `server_key` is that endpoint's
    CURVE public key (Z85) when it has one. Messages that do not decode are
    skipped (a newer supervisor may publish what this client does not know).
    `timeout` bounds the wait for each one. `first` is called once the socket is
    connected, before any message is read, and what it returns is yielded first
    (`watch` replays the supervisor's recent events so).
    """
    endpoint = endpoint or Endpoints.load(runtime_dir).pub
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
    if server_key:
        public, secret = zmq.curve_keypair()  # this client's own, for this connection only
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    for topic in topics or [""]:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoint)
    codec = p.Codec(p.Published)
    try:
        if first is not None:
            yield from first()
        while True:
            if timeout is not None and not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise TimeoutError(f"no message on {topics or 'any topic'} within {timeout} s")
            frames = sock.recv_multipart()
            if len(frames) != 2:
                continue
            msg = codec.decode(frames[1])
            if isinstance(msg, p.Malformed):
                continue
            yield frames[0].decode(errors="replace"), msg
    finally:
        sock.close(0)
