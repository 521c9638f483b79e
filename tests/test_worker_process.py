"""A real worker process driven by a test-owned supervisor socket: what it does
with frames no supervisor should send."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import multiprocess
import pytest
import zmq

from shared import protocol as p
from shared.ledger import Ledger
from worker.main import run as worker_main

pytestmark = pytest.mark.slow


def _recv(router: zmq.Socket, codec: p.Codec, want: type, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.poll(100):
            _ident, frame = router.recv_multipart()
            msg = codec.decode(frame)
            if isinstance(msg, want):
                return msg
    raise AssertionError(f"no {want.__name__} from the worker")


def test_worker_counts_and_ignores_malformed_oversized_and_wrong_version_commands(tiny_model, tmp_path, capfd):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.bind(f"ipc://{tmp_path}/c.sock")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/r.sock")
    ledger = Ledger.create(tmp_path / "ledger", 2)
    spec = p.WorkerSpec(worker_id="w#1", model_id="m", model_path=str(tiny_model), slot=0,
                        ledger_path=str(tmp_path / "ledger"), commands=f"ipc://{tmp_path}/c.sock",
                        reports=f"ipc://{tmp_path}/r.sock", supervisor_pid=os.getpid())
    proc = multiprocess.get_context("spawn").Process(target=worker_main, args=(msgspec.msgpack.encode(spec),))
    proc.start()
    try:
        replies = p.Codec(p.WorkerReply)
        hello = _recv(router, replies, p.Hello)
        assert hello.pid == proc.pid and hello.v == p.PROTOCOL_VERSION
        _recv(router, replies, p.Loaded)
        ident = b"w#1"
        bad = [
            b"\xc1not msgpack",
            msgspec.msgpack.encode({"type": "ping", "v": 99, "seq": 1, "cmd": 0}),  # another version
            msgspec.msgpack.encode({"type": "ping", "v": 99, "seq": 2, "cmd": 0}),  # ... again
            msgspec.msgpack.encode({"type": "set_limits", "v": 1, "limits": {"hard_limit": "lots"}}),
            msgspec.msgpack.encode({"type": "launch_missiles", "v": 1}),
            # over ZMQ_MAXMSGSIZE: the transport drops the frame and the
            # connection; the worker's DEALER reconnects by itself
            b"\x00" * (p.MAX_FRAME_BYTES + 1),
        ]
        for frame in bad:
            router.send_multipart([ident, frame])
        pong = None
        for seq in range(70, 90):  # pings sent while it reconnects are lost; retry
            router.send_multipart([ident, p.Codec(p.CommandMsg).encode(p.Ping(seq=seq))])
            try:
                pong = _recv(router, replies, p.Pong, timeout=0.5)
                break
            except AssertionError:
                continue
        assert pong is not None and proc.is_alive()
        # still generating after the garbage
        router.send_multipart([ident, p.Codec(p.CommandMsg).encode(
            p.Generate(request_id="r", prompt="hi", max_tokens=3))])
        done = _recv(router, replies, p.Finished, timeout=30)
        assert done.completion_tokens == 3
        router.send_multipart([ident, p.Codec(p.CommandMsg).encode(p.Drain(reason="test over"))])
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        router.close(0)
        pull.close(0)
        ctx.term()
        ledger.close()
    err = capfd.readouterr().err
    assert err.count("peer speaks protocol v99") == 1  # logged once, though sent twice
    assert "ignored a bad command frame" in err


def test_worker_exits_when_the_supervisor_pid_is_not_its_parent(tiny_model, tmp_path):
    """Elsewhere than Linux the worker notices its parent is gone by getppid();
    started with a supervisor pid that is not its parent, it must exit at once."""
    spec = p.WorkerSpec(worker_id="w#2", model_id="m", model_path=str(tiny_model), slot=0,
                        ledger_path=str(tmp_path / "missing"), commands=f"ipc://{tmp_path}/c.sock",
                        reports=f"ipc://{tmp_path}/r.sock", supervisor_pid=1)
    proc = multiprocess.get_context("spawn").Process(target=worker_main, args=(msgspec.msgpack.encode(spec),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0


def test_drain_finishes_a_request_that_waits_for_memory_before_the_worker_exits(tiny_model, tmp_path):
    """Drain means: finish what runs, take nothing new, then exit. A request whose
    prefill waited for the supervisor's eviction answer (G1) made the engine look
    idle, so a drained worker exited at once and dropped it without an answer."""
    from shared.limits import Limits
    from shared.sizes import GiB

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/c.sock")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/r.sock")
    ledger = Ledger.create(tmp_path / "ledger", 2)
    spec = p.WorkerSpec(worker_id="w#3", model_id="m", model_path=str(tiny_model), slot=0,
                        ledger_path=str(tmp_path / "ledger"), commands=f"ipc://{tmp_path}/c.sock",
                        reports=f"ipc://{tmp_path}/r.sock", supervisor_pid=os.getpid())
    proc = multiprocess.get_context("spawn").Process(target=worker_main, args=(msgspec.msgpack.encode(spec),))
    proc.start()
    replies, commands, ident = p.Codec(p.WorkerReply), p.Codec(p.CommandMsg), b"w#3"
    try:
        _recv(router, replies, p.Loaded)
        own = ledger.read_sample(0).usage
        # Room for this worker's prefill, but not beside 2 GiB of "other models": G1 asks to evict.
        ledger.write_limits(0, Limits(hard_limit=own + GiB, soft_limit=own + GiB, hard_watermark=own + GiB,
                                      max_concurrency=4))
        ledger.write_supervisor(2 * GiB, 0.0)
        router.send_multipart([ident, commands.encode(p.Generate(request_id="r", prompt="hi", max_tokens=3))])
        assert _recv(router, replies, p.NeedMemory).request_id == "r"
        router.send_multipart([ident, commands.encode(p.Drain(reason="unloaded"))])
        _recv(router, replies, p.Ack)
        time.sleep(0.5)
        assert proc.is_alive(), "the drained worker left with a request still waiting"
        ledger.write_supervisor(0, 0.0)  # the supervisor evicted the others
        router.send_multipart([ident, commands.encode(p.MemoryAnswer(request_id="r", evicted=True))])
        assert _recv(router, replies, p.Finished).completion_tokens == 3
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        router.close(0)
        pull.close(0)
        ctx.term()
        ledger.close()
