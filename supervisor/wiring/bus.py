"""The supervisor's ZeroMQ sockets, run inside its asyncio loop.

Sockets are plain (blocking-API) pyzmq sockets driven by the loop's reader
callbacks on ZMQ_FD: when the descriptor wakes, every queued frame is drained
with NOBLOCK in one go. That keeps sample ingest at C speed and out of
per-message coroutine overhead. ZMQ_FD is edge-triggered, so after any send
on a socket we also schedule a drain (a send can consume the edge).

Every frame goes through a `Codec`; what cannot be decoded is counted per
socket and fixed cause, logged at most once a minute per cause, and dropped. Nothing a peer sends can
raise into the loop.

The PUB sockets are XPUBs with a last-value cache: a new
subscriber's subscription reaches the loop, which sends it the latest
ceiling, pressure and status at once instead of letting it wait up to one
slow tick (10-30 s) for the next. ZeroMQ filters by topic only, so that
repeat also reaches the subscribers already on those topics: they see the
same state twice, which for state topics changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Literal, cast

import msgspec
import zmq

from shared import protocol as p
from shared.vocab import MalformedCause
from supervisor.wiring.subscribers import SubscriberCap

log = logging.getLogger("memvisor.bus")

DRAIN_BATCH = 1000  # frames taken from one socket before the loop runs anything else
# Messages queued per subscriber before PUB drops for it: a slow or stalled
# subscriber costs at most this many frames of memory (status frames are the
# largest, a few KiB), never 10,000 of them.
PUB_HWM = 1000
MAX_SUBSCRIBERS = 64  # the default of [supervisor] max_subscribers
BAD_LOG_EVERY = 60.0  # seconds between two log lines of one refused-frame cause
LATEST_TOPICS = ("ceiling", "pressure", "status")  # state topics a new subscriber gets at once
# Plain ints: pyzmq's constants are enum members, and `int & IntFlag` builds a new
# member through enum's machinery (~1 us a frame on the token path, issue 33's profile).
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE), int(zmq.NOBLOCK)

# Why a frame was refused: what the decoder found (shared.vocab.MalformedCause), or what
# the bus and the pool find around a decoded message. A fixed set, so counters and logs
# stay bounded whatever a peer sends.
BadCause = Literal[MalformedCause, "frame_count", "unknown_peer", "hello_mismatch"]


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    """Where a running supervisor listens; written to RUNTIME/endpoints.json."""

    commands: str
    reports: str
    pub: str
    control: str
    pid: int = 0
    http: str = ""
    pub_tcp: str = ""       # opt-in TCP PUB endpoint ("" = none)
    pub_tcp_key: str = ""   # its CURVE public key (Z85), when it has one

    @classmethod
    def in_dir(cls, runtime_dir: Path, pid: int = 0, http: str = "") -> "Endpoints":
        return cls(
            commands=f"ipc://{runtime_dir}/commands.sock",
            reports=f"ipc://{runtime_dir}/reports.sock",
            pub=f"ipc://{runtime_dir}/pub.sock",
            control=f"ipc://{runtime_dir}/control.sock",
            pid=pid,
            http=http,
        )

    def save(self, runtime_dir: Path) -> None:
        tmp = runtime_dir / "endpoints.json.tmp"
        tmp.write_bytes(msgspec.json.encode(self))
        os.replace(tmp, runtime_dir / "endpoints.json")

    @classmethod
    def load(cls, runtime_dir: Path) -> "Endpoints":
        path = runtime_dir / "endpoints.json"
        try:
            return msgspec.json.decode(path.read_bytes(), type=cls)
        except FileNotFoundError:
            raise NotRunning(f"no supervisor runs with runtime dir {runtime_dir} (no {path})") from None
        except msgspec.DecodeError as exc:
            raise NotRunning(f"{path} is unreadable: {exc}") from None


class NotRunning(RuntimeError):
    pass


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_runtime_dir(runtime_dir: Path) -> None:
    """Refuse a runtime directory another live supervisor serves from.

    Binding would unlink its sockets from under it. A leftover endpoints.json
    of a supervisor that died is simply replaced.
    """
    try:
        other = Endpoints.load(runtime_dir)
    except NotRunning:
        return
    if pid_alive(other.pid):
        raise RuntimeDirBusy(
            f"another supervisor (pid {other.pid}) runs with runtime dir {runtime_dir}; "
            "stop it, or give this one its own --runtime-dir"
        )


class RuntimeDirBusy(RuntimeError):
    pass


class BusError(RuntimeError):
    """A socket the configuration asks for cannot be set up; says which and why."""


class FrameTooLarge(ValueError):
    """A command the worker's codec would drop unread (over MAX_COMMAND_BYTES)."""


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _xpub(sock: zmq.Socket) -> None:
    """A PUB socket that also hands every subscription to the loop (for `_replay`)."""
    sock.setsockopt(zmq.SNDHWM, PUB_HWM)
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only a topic's first


def _recv_multipart(recv: Callable[..., bytes], ready: Callable[[int], int]) -> list[bytes]:
    """One whole message's frames, as `Socket.recv_multipart(NOBLOCK)` takes them, without its
    per-call wrapping: every token of every stream passes here (issue 33's profile: 3.2 against
    4.5 us of CPU a frame, with the int masks above). A message's frames arrive together, so
    only the first receive can find nothing (zmq.Again)."""
    frames = [recv(_NOBLOCK)]
    while ready(_RCVMORE):
        frames.append(recv(_NOBLOCK))
    return frames


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


class Bus:
    """Binds the four sockets and dispatches decoded messages to handlers."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, max_subscribers: int = MAX_SUBSCRIBERS) -> None:
        self.ctx = ctx
        self.endpoints = endpoints
        self.subscribers = SubscriberCap(ctx, max_subscribers)  # before the PUB sockets bind: no subscriber slips in uncounted
        self.malformed: Counter[tuple[str, BadCause]] = Counter()
        self._logged: dict[tuple[str, str], float] = {}  # (socket, cause) -> when last logged
        self.commands = self._bind(zmq.ROUTER, endpoints.commands)
        self.commands.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.commands.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker keeps its identity
        self.reports = self._bind(zmq.PULL, endpoints.reports)
        self.pub = self._bind(zmq.XPUB, endpoints.pub, capped=True)
        _xpub(self.pub)
        self.control = self._bind(zmq.ROUTER, endpoints.control)
        self.pub_tcp: zmq.Socket | None = None
        self.command_codec = p.Codec(p.CommandMsg)
        self.reply_codec = p.Codec(p.WorkerReply)
        self.report_codec = p.Codec(p.WorkerReport)
        self.pub_codec = p.Codec(p.Published)
        self.control_codec = p.Codec(p.ControlRequest)
        self.control_reply_codec = p.Codec(p.ControlReply)
        self._loop: asyncio.AbstractEventLoop | None = None
        # in-process subscribers of every PUB message (the SSE hub); called, never awaited
        self.listeners: list[Callable[[p.Msg], None]] = []
        # the last frames published per state topic, and the topics a new subscriber
        # asked for since the last replay (a flood of subscriptions costs one replay per drain)
        self.latest: dict[str, list[bytes]] = {}
        self._wanted: dict[zmq.Socket, set[str]] = {}
        self._pub_rearmed: set[zmq.Socket] = set()
        self.replays = 0

    def _bind(self, kind: int, endpoint: str, capped: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if capped:
            self.subscribers.guard(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        path = _ipc_path(endpoint)
        if path and os.path.exists(path):
            os.unlink(path)  # a stale socket of a supervisor that died
        sock.bind(endpoint)
        if path:
            os.chmod(path, 0o600)
        return sock

    def bind_pub_tcp(self, address: str, curve_key_file: str = "") -> tuple[str, str]:
        """A second PUB socket on TCP, for dashboards elsewhere (opt-in).

        Its own socket, so CURVE (when keys are given) applies to TCP peers
        only and local `watch` keeps the plain ipc endpoint. Returns the bound
        endpoint and the CURVE public key ("" without keys).
        """
        import zmq.auth

        host, port = _split_host_port(address)
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        _xpub(sock)
        self.subscribers.guard(sock)
        public = b""
        if curve_key_file:
            try:
                public, secret = zmq.auth.load_certificate(curve_key_file)
            except (OSError, ValueError) as exc:
                sock.close(0)
                raise BusError(f"cannot read the CURVE key file {curve_key_file}: {exc}") from None
            if not secret:
                sock.close(0)
                raise BusError(f"{curve_key_file} holds no secret key (give the .key_secret file)")
            sock.curve_server = True
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        host_part = f"[{host}]" if ":" in host else host
        try:
            if port == 0:
                port = sock.bind_to_random_port(f"tcp://{host_part}")
            else:
                sock.bind(f"tcp://{host_part}:{port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            raise BusError(f"cannot bind PUB on {address}: {exc}") from None
        self.pub_tcp = sock
        return f"tcp://{host_part}:{port}", public.decode()

    # -- reading ----------------------------------------------------------

    def attach(
        self,
        loop: asyncio.AbstractEventLoop,
        on_reply: Callable[[bytes, p.WorkerReply], None],
        on_report: Callable[[p.WorkerReport], None],
        on_control: Callable[[bytes, p.ControlRequest], None],
    ) -> None:
        self._loop = loop
        self._handlers: dict[zmq.Socket, Callable[[list[bytes]], None]] = {
            self.commands: lambda frames: self._routed("commands", frames, self.reply_codec, on_reply),
            self.reports: lambda frames: self._plain("reports", frames, self.report_codec, on_report),
            self.control: lambda frames: self._routed("control", frames, self.control_codec, on_control),
            self.subscribers.zap: self._zap,
            self.pub: functools.partial(self._subscription, self.pub),
        }
        if self.pub_tcp is not None:
            self._handlers[self.pub_tcp] = functools.partial(self._subscription, self.pub_tcp)
        for index, monitor in enumerate(self.subscribers.monitors):
            self._handlers[monitor] = functools.partial(self.subscribers.on_monitor, index)
        for sock in self._handlers:
            loop.add_reader(sock.getsockopt(zmq.FD), self._drain, sock)  # type: ignore[arg-type]
            loop.call_soon(self._drain, sock)

    def _drain(self, sock: zmq.Socket) -> None:
        """Take up to DRAIN_BATCH frames, then yield to the loop and come back:
        a peer flooding one socket must not starve the others or the guard."""
        if sock.closed:  # closed after this drain was scheduled (a start that failed, a shutdown)
            return
        handler = self._handlers[sock]
        ready, recv = cast(Callable[[int], int], sock.getsockopt), sock.recv  # EVENTS and RCVMORE are ints
        for _ in range(DRAIN_BATCH):
            if not ready(_EVENTS) & _POLLIN:
                return
            try:
                frames = _recv_multipart(recv, ready)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # a bug in a handler must not stop the socket
                log.exception("handler for %s failed", sock)
        assert self._loop is not None
        self._loop.call_soon(self._drain, sock)  # more may wait; the edge will not fire again

    def _subscription(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        """An XPUB's (un)subscription frame: b"\\x01" + prefix subscribes. The state topics
        that prefix covers are replayed once this drain is over (`_replay`)."""
        if len(frames) != 1 or not frames[0] or frames[0][0] != 1:
            return  # an unsubscription, or nothing a SUB socket sends
        prefix = frames[0][1:]
        topics = {topic for topic in LATEST_TOPICS if topic.encode().startswith(prefix)}
        if not topics:
            return
        if sock not in self._wanted:
            assert self._loop is not None
            self._loop.call_soon(self._replay, sock)
        self._wanted.setdefault(sock, set()).update(topics)

    def _replay(self, sock: zmq.Socket) -> None:
        """The latest frames of the topics new subscribers asked for, sent on `sock`."""
        for topic in sorted(self._wanted.pop(sock, ()), key=LATEST_TOPICS.index):
            frames = self.latest.get(topic)
            if frames is None:
                continue
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                self.replays += 1
            except zmq.ZMQError:
                pass  # a slow subscriber loses messages; the guard does not wait
        self._rearm(sock)

    def _rearmed_drain(self, sock: zmq.Socket) -> None:
        self._pub_rearmed.discard(sock)
        self._drain(sock)

    def _zap(self, frames: list[bytes]) -> None:
        self.subscribers.on_zap(frames)
        self._rearm(self.subscribers.zap)

    def _routed(self, name: str, frames: list[bytes], codec: p.Codec, handler) -> None:
        if len(frames) != 2:
            self.bad(name, "frame_count", f"expected 2 frames (identity, message), got {len(frames)}")
            return
        msg = codec.decode(frames[1])
        if isinstance(msg, p.Malformed):
            self.bad(name, msg.cause, msg.reason, peer=frames[0])
            return
        handler(frames[0], msg)

    def _plain(self, name: str, frames: list[bytes], codec: p.Codec, handler) -> None:
        if len(frames) != 1:
            self.bad(name, "frame_count", f"expected 1 frame, got {len(frames)}")
            return
        msg = codec.decode(frames[0])
        if isinstance(msg, p.Malformed):
            self.bad(name, msg.cause, msg.reason)
            return
        handler(msg)

    def bad(self, socket_name: str, cause: BadCause, reason: str, peer: bytes = b"") -> None:
        """Count a refused frame under a fixed cause; log each cause at most
        once per BAD_LOG_EVERY seconds.

        The key is never text the sender controls (a message type name, a
        version number, a peer identity): keyed on that, 100k distinct garbage
        frames grew the counter, the "logged once" set and the log without
        bound."""
        key = (socket_name, cause)
        self.malformed[key] += 1
        now = time.monotonic()
        last = self._logged.get(key)
        if last is not None and now - last < BAD_LOG_EVERY:
            return
        self._logged[key] = now
        who = f" from {peer[:64]!r}" if peer else ""
        log.warning("refused a frame on %s%s: %s: %s (%d so far; next log of this cause in %.0f s at the earliest)",
                    socket_name, who, cause, reason[:200], self.malformed[key], BAD_LOG_EVERY)

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())

    # -- writing ----------------------------------------------------------

    def send_command(self, identity: bytes, msg: p.Msg) -> bool:
        """False when the worker is not connected (ROUTER_MANDATORY).

        A frame over MAX_FRAME_BYTES raises FrameTooLarge rather than go out:
        the worker would drop it unread, so a Generate would never get its
        terminal message and its client would wait forever."""
        frame = self.command_codec.encode(msg)
        if len(frame) > p.MAX_COMMAND_BYTES:
            raise FrameTooLarge(f"{type(msg).__name__} of {len(frame)} bytes exceeds the "
                                f"{p.MAX_COMMAND_BYTES} bytes a worker accepts")
        try:
            self.commands.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False
        finally:
            self._rearm(self.commands)

    def send_control_reply(self, identity: bytes, msg: p.Msg) -> None:
        try:
            self.control.send_multipart([identity, self.control_reply_codec.encode(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            log.debug("control reply to %r dropped: %s", identity, exc)
        finally:
            self._rearm(self.control)

    def publish(self, msg: p.Msg) -> None:
        topic = p.TOPIC_OF[type(msg)]
        frames = [topic.encode(), self.pub_codec.encode(msg)]
        if topic in LATEST_TOPICS:
            self.latest[topic] = frames
        for sock in (self.pub, self.pub_tcp):
            if sock is None:
                continue
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass  # a slow subscriber loses messages; the guard does not wait
            if sock not in self._pub_rearmed and self._loop is not None:  # the send may have taken the
                self._pub_rearmed.add(sock)  # FD's edge: look once this loop turn (an EVENTS read a send costs 3 us)
                self._loop.call_soon(self._rearmed_drain, sock)
        for listener in self.listeners:  # the SSE hub (supervisor.wiring.fanout)
            try:
                listener(msg)
            except Exception:  # a bug there must not stop the guard that publishes
                log.exception("in-process subscriber %r failed", listener)

    def add_listener(self, listener: Callable[[p.Msg], None]) -> None:
        """`listener(msg)` for every PUB message, in the loop, after the socket send."""
        self.listeners.append(listener)

    def _rearm(self, sock: zmq.Socket) -> None:
        if self._loop is not None:
            self._loop.call_soon(self._drain, sock)

    def close(self) -> None:
        if self._loop is not None:
            for sock in self._handlers:
                try:
                    self._loop.remove_reader(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]
                except (zmq.ZMQError, ValueError):
                    pass
        for open_sock in (self.commands, self.reports, self.pub, self.control, self.pub_tcp):
            if open_sock is not None:
                open_sock.close(0)
        self.subscribers.close()
        for endpoint in (self.endpoints.commands, self.endpoints.reports, self.endpoints.pub, self.endpoints.control):
            path = _ipc_path(endpoint)
            if path and os.path.exists(path):
                os.unlink(path)
