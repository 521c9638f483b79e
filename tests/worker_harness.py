"""One real worker process against a supervisor end the test owns: its sockets and its ledger.

For tests that must send a worker frames no real supervisor would send, or read
exactly what it answers, without the arbiter's judgement in between.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import multiprocess
import zmq

from shared import protocol as p
from shared.ledger import Ledger
from worker.main import run as worker_main


class FakeSupervisor:
    """The supervisor's end of a worker's sockets and ledger, owned by the test,
    with one real worker process spawned against it."""

    def __init__(self, tmp_path: Path, model: Path, worker_id: str) -> None:
        self.ident = worker_id.encode()
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.bind(f"ipc://{tmp_path}/c.sock")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{tmp_path}/r.sock")
        self.ledger = Ledger.create(tmp_path / "ledger", 2)
        self.replies, self.commands = p.Codec(p.WorkerReply), p.Codec(p.CommandMsg)
        self.proc = spawn_worker(tmp_path, model, worker_id, os.getpid())

    def send(self, msg: p.Msg) -> None:
        self.send_raw(self.commands.encode(msg))

    def send_raw(self, frame: bytes) -> None:
        self.router.send_multipart([self.ident, frame])

    def recv(self, want: type, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll(100):
                _ident, frame = self.router.recv_multipart()
                msg = self.replies.decode(frame)
                if isinstance(msg, want):
                    return msg
        raise AssertionError(f"no {want.__name__} from the worker")

    def __enter__(self) -> "FakeSupervisor":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.router.close(0)
        self.pull.close(0)
        self.ctx.term()
        self.ledger.close()


def spawn_worker(tmp_path: Path, model: Path, worker_id: str, supervisor_pid: int):
    spec = p.WorkerSpec(worker_id=worker_id, model_id="m", model_path=str(model), slot=0,
                        ledger_path=str(tmp_path / "ledger"), commands=f"ipc://{tmp_path}/c.sock",
                        reports=f"ipc://{tmp_path}/r.sock", supervisor_pid=supervisor_pid)
    proc = multiprocess.get_context("spawn").Process(target=worker_main, args=(msgspec.msgpack.encode(spec),))
    proc.start()
    return proc
