"""A cap on PUB subscribers, enforced by ZeroMQ's own ZAP hook.

Any number of subscribers could connect, and each could queue up to the
high-water mark of messages in the supervisor's memory. PUB has no way to
turn one peer away, but ZAP (the ZeroMQ authentication protocol) asks a
handler about every new connection of a socket that names a ZAP domain, for
the NULL mechanism as for CURVE. So: a socket monitor counts the connected
peers (accepted minus disconnected), and the handler answers 400 past
`max_subscribers`. A refused subscriber reconnects on its own later and gets
in once a place is free. Both PUB sockets (ipc and the opt-in TCP one) share
the cap.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("memvisor.bus")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC, one per context
ZAP_DOMAIN = b"memvisor-pub"
REFUSED_LOG_EVERY = 60.0


class SubscriberCap:
    def __init__(self, ctx: zmq.Context, limit: int) -> None:
        self.limit = limit
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.monitors: list[zmq.Socket] = []
        self.peers: set[tuple[int, int]] = set()  # (monitor index, fd)
        self.refused = 0
        self._logged = 0.0

    def guard(self, pub: zmq.Socket) -> zmq.Socket:
        """Call before `pub` binds; returns its monitor socket (to be read by the loop)."""
        pub.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        monitor = pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.monitors.append(monitor)
        return monitor

    def on_monitor(self, index: int, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)
        except (ValueError, IndexError):
            return
        key = (index, int(event["value"]))
        if event["event"] == zmq.EVENT_ACCEPTED:
            self.peers.add(key)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self.peers.discard(key)

    def on_zap(self, frames: list[bytes]) -> None:
        """ZAP request -> 200, or 400 past the cap (the peer counts itself)."""
        if len(frames) < 6:
            return
        for index, monitor in enumerate(self.monitors):  # count what has happened until now
            while monitor.poll(0):
                self.on_monitor(index, monitor.recv_multipart())
        ok = frames[2] != ZAP_DOMAIN or len(self.peers) <= self.limit
        if not ok:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged >= REFUSED_LOG_EVERY:
                self._logged = now
                log.warning("refused a subscriber: %d connected, the cap is %d ([supervisor] max_subscribers); "
                            "%d refused so far", len(self.peers) - 1, self.limit, self.refused)
        reply = [frames[0], frames[1], b"200" if ok else b"400", b"OK" if ok else b"too many subscribers", b"", b""]
        try:
            self.zap.send_multipart(reply, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    @property
    def connected(self) -> int:
        return len(self.peers)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close(0)
        self.zap.close(0)
