"""Requests sent together to an idle worker are prefilled together (worker/loop.py `gather_burst`).

A real worker process against a test-owned supervisor socket: four `Generate`s, the
first alone and the other three a few ms behind it, as the supervisor hands on four
HTTP requests sent at once. Each step is made long (MEMVISOR_TEST_STEP_DELAY), so a
worker that stepped as soon as the first arrived read the others only after that
step: the first prefilled and decoded alone, ahead of a group of three.
"""

from __future__ import annotations

import time

import pytest

from shared import protocol as p
from shared.limits import Limits
from tests.worker_harness import FakeSupervisor

pytestmark = pytest.mark.slow

GAP = 0.004          # the first request, then the others this long after it
SETUP_HELD = 0.012   # ... the setup holds only if all were sent within this (under BURST_QUIET_MS)


def first_token_frames(sup: FakeSupervisor, ids: list[str], timeout: float = 60.0) -> list[set[str]]:
    """Read until every request finished: the requests whose first token each frame carried, in order."""
    waiting, running, frames = set(ids), set(ids), []
    deadline = time.monotonic() + timeout
    while running and time.monotonic() < deadline:
        if not sup.router.poll(100):
            continue
        _ident, frame = sup.router.recv_multipart()
        msg = sup.replies.decode(frame)
        if isinstance(msg, p.Finished):
            running.discard(msg.request_id)
            continue
        if isinstance(msg, p.TokenBatch):
            rows = set(msg.request_ids)
        elif isinstance(msg, p.TokenOut):
            rows = {msg.request_id}
        else:
            continue
        if rows & waiting:
            frames.append(rows & waiting)
            waiting -= rows
    assert not running, f"{sorted(running)} did not finish"
    return frames


def test_requests_arriving_together_at_an_idle_worker_share_one_prefill_group_and_decode_batch(
        tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMVISOR_TEST_STEP_DELAY", "0.3")  # the worker inherits it
    with FakeSupervisor(tmp_path, tiny_model, "w#burst") as sup:
        sup.recv(p.Loaded)
        sup.ledger.write_limits(0, Limits(max_concurrency=4))  # guard off, four at once (SPEC P8)
        for attempt in range(3):
            ids = [f"b{attempt}-{i}" for i in range(4)]
            started = time.monotonic()
            sup.send(p.Generate(request_id=ids[0], prompt=f"first of a burst {attempt}", max_tokens=3))
            time.sleep(GAP)
            for i, rid in enumerate(ids[1:], 1):
                sup.send(p.Generate(request_id=rid, prompt=f"request {i} of burst {attempt} here", max_tokens=3))
            held = time.monotonic() - started <= SETUP_HELD
            frames = first_token_frames(sup, ids)
            if held:
                break
        else:
            pytest.skip("the test process could not send 4 frames within 12 ms in 3 tries (a loaded machine)")
        # one group and one decode batch: every first token in the same step's frame
        assert frames == [set(ids)], f"first tokens came in {frames}"
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
        assert sup.proc.exitcode == 0
