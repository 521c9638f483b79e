"""A real worker process driven by a test-owned supervisor socket: what it does
with frames no supervisor should send."""

from __future__ import annotations

import time

import msgspec
import pytest

from shared import protocol as p
from shared.limits import Limits
from tests.worker_harness import FakeSupervisor, spawn_worker

pytestmark = pytest.mark.slow


def test_worker_counts_and_ignores_malformed_oversized_and_wrong_version_commands(tiny_model, tmp_path, capfd):
    with FakeSupervisor(tmp_path, tiny_model, "w#1") as sup:
        hello = sup.recv(p.Hello)
        assert hello.pid == sup.proc.pid and hello.v == p.PROTOCOL_VERSION
        sup.recv(p.Loaded)
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
            sup.send_raw(frame)
        pong = None
        for seq in range(70, 90):  # pings sent while it reconnects are lost; retry
            sup.send(p.Ping(seq=seq))
            try:
                pong = sup.recv(p.Pong, timeout=0.5)
                break
            except AssertionError:
                continue
        assert pong is not None and sup.proc.is_alive()
        # still generating after the garbage
        sup.send(p.Generate(request_id="r", prompt="hi", max_tokens=3))
        done = sup.recv(p.Finished, timeout=30)
        assert done.completion_tokens == 3
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
        assert sup.proc.exitcode == 0
    err = capfd.readouterr().err
    assert err.count("peer speaks protocol v99") == 1  # logged once, though sent twice
    assert "ignored a bad command frame" in err


def test_worker_exits_when_the_supervisor_pid_is_not_its_parent(tiny_model, tmp_path):
    """Elsewhere than Linux the worker notices its parent is gone by getppid();
    started with a supervisor pid that is not its parent, it must exit at once."""
    proc = spawn_worker(tmp_path, tiny_model, "w#2", supervisor_pid=1)  # no ledger: it must not get that far
    proc.join(30)
    assert proc.exitcode == 0


def test_drain_finishes_a_request_that_waits_for_memory_before_the_worker_exits(tiny_model, tmp_path):
    """Drain means: finish what runs, take nothing new, then exit. A request whose
    prefill waited for the supervisor's eviction answer (G1) made the engine look
    idle, so a drained worker exited at once and dropped it without an answer."""
    from shared.limits import Limits
    from shared.sizes import GiB

    with FakeSupervisor(tmp_path, tiny_model, "w#3") as sup:
        sup.recv(p.Loaded)
        own = sup.ledger.read_sample(0).memory.usage
        # Room for this worker's prefill, but not beside 2 GiB of "other models": G1 asks to evict.
        sup.ledger.write_limits(0, Limits(hard_limit=own + GiB, soft_limit=own + GiB, hard_watermark=own + GiB,
                                          max_concurrency=4))
        sup.ledger.write_supervisor(2 * GiB, 0.0)
        sup.send(p.Generate(request_id="r", prompt="hi", max_tokens=3))
        assert sup.recv(p.NeedMemory).request_id == "r"
        sup.send(p.Drain(reason="unloaded"))
        sup.recv(p.Ack)
        time.sleep(0.5)
        assert sup.proc.is_alive(), "the drained worker left with a request still waiting"
        sup.ledger.write_supervisor(0, 0.0)  # the supervisor evicted the others
        sup.send(p.MemoryAnswer(request_id="r", evicted=True))
        assert sup.recv(p.Finished).completion_tokens == 3
        sup.proc.join(20)
        assert sup.proc.exitcode == 0


def test_d4_worker_reports_a_device_watermark_crossing_at_once(tiny_model, tmp_path):
    """The supervisor hands the device pool's watermarks in the limits (D4); the
    worker measures the group's device bytes (D1's fallback: MLX active + pool)
    and sends a `watermark` sample as soon as they cross one, so the enforcer
    ticks at once instead of at its next poll (P9). On this CPU machine MLX's
    bytes stand in for device bytes; the arithmetic on both ends is the same."""
    from shared.limits import Limits

    with FakeSupervisor(tmp_path, tiny_model, "w#4") as sup:
        sup.recv(p.Loaded)
        held = sup.ledger.read_sample(0).memory
        on_device = held.mlx_active + held.mlx_pool
        assert on_device > 0
        assert sup.ledger.group_device_bytes() == on_device
        limits = Limits(device_soft=on_device // 2, device_hard=on_device * 4, max_concurrency=1)
        sup.ledger.write_limits(0, limits)
        sup.send(p.SetLimits(limits=limits))
        reports = p.Codec(p.WorkerReport)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if sup.pull.poll(100):
                msg = reports.decode(sup.pull.recv())
                if isinstance(msg, p.Sample) and msg.why == "watermark":
                    assert msg.memory.mlx_active + msg.memory.mlx_pool >= limits.device_soft
                    break
        else:
            raise AssertionError("no watermark sample after the device soft watermark was crossed")
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)


def _replies_until_finished(sup: FakeSupervisor, ids: set[str], timeout: float = 60.0) -> list[p.Msg]:
    """Every reply for `ids` in arrival order (token batches unfolded) until each has finished."""
    out: list[p.Msg] = []
    waiting, deadline = set(ids), time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        if not sup.router.poll(100):
            continue
        msg = sup.replies.decode(sup.router.recv_multipart()[1])
        rows = msg.tokens() if isinstance(msg, p.TokenBatch) else [msg]
        for row in rows:
            if getattr(row, "request_id", None) in ids:
                out.append(row)
                if isinstance(row, (p.Finished, p.Failed)):
                    waiting.discard(row.request_id)
    assert not waiting, f"no Finished for {waiting}"
    return out


def test_prompted_comes_before_the_first_token_and_agrees_with_finished(tiny_model, tmp_path):
    """The worker's `Prompted` arrives before a request's first token, with the
    prompt length and prompt-cache reuse its `Finished` reports at the end (prefilled
    together, alone, and a repeated prompt served from the prompt cache)."""
    chat = [p.ChatMessage(role="user", content="memory pressure guard worker model cache " * 6)]
    with FakeSupervisor(tmp_path, tiny_model, "w#1") as sup:
        sup.recv(p.Loaded)
        sup.send(p.SetLimits(cmd=1, limits=Limits(cache_cap=64 * 1024 * 1024)))
        sup.send(p.Generate(request_id="a", messages=chat, max_tokens=3, temperature=0.0))
        sup.send(p.Generate(request_id="b", prompt="supervisor prefill budget ceiling " * 5, max_tokens=3,
                            temperature=0.0))
        first = _replies_until_finished(sup, {"a", "b"})
        sup.send(p.Generate(request_id="c", messages=chat, max_tokens=3, temperature=0.0))
        again = _replies_until_finished(sup, {"c"})
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
    for rid, replies in (("a", first), ("b", first), ("c", again)):
        mine = [m for m in replies if m.request_id == rid]  # type: ignore[attr-defined]
        assert isinstance(mine[0], p.Prompted), [type(m).__name__ for m in mine]
        assert sum(isinstance(m, p.Prompted) for m in mine) == 1
        prompted, finished = mine[0], mine[-1]
        assert isinstance(finished, p.Finished) and finished.completion_tokens == 3
        assert prompted.prompt_tokens == finished.prompt_tokens > 0
        assert prompted.cached_tokens == finished.cached_tokens
    c_prompted = next(m for m in again if isinstance(m, p.Prompted))
    assert c_prompted.cached_tokens > 0  # the repeat reused the prompt cache, and says so up front


def _tokens_reply(sup: FakeSupervisor, rid: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sup.router.poll(100):
            msg = sup.replies.decode(sup.router.recv_multipart()[1])
            if isinstance(msg, (p.Tokenized, p.Detokenized, p.Failed)) and msg.request_id == rid:
                return msg
    raise AssertionError(f"no answer for {rid}")


def test_tokenize_and_detokenize_are_answered_while_a_generation_runs(tiny_model, tmp_path):
    """The worker's end of /tokenize: each command gets one reply of its request id
    (a bad token id a Failed naming it), between two steps of a running generation, which
    still finishes."""
    with FakeSupervisor(tmp_path, tiny_model, "w#1") as sup:
        sup.recv(p.Loaded)
        sup.send(p.Generate(request_id="g", prompt="memory guard " * 20, max_tokens=16, temperature=0.0))
        sup.send(p.Tokenize(request_id="t", text="hello world", add_special=True, with_pieces=True))
        tokenized = _tokens_reply(sup, "t")
        sup.send(p.Detokenize(request_id="d", tokens=tokenized.tokens))
        detokenized = _tokens_reply(sup, "d")
        sup.send(p.Detokenize(request_id="x", tokens=[7, 10**6]))
        refused = _tokens_reply(sup, "x")
        # _tokens_reply skipped g's replies: its Finished still to come means the three answers
        # came while it ran (the commands arrive together; the worker takes them between steps)
        finished = _replies_until_finished(sup, {"g"})[-1]
        sup.send(p.Drain(reason="test over"))
        sup.proc.join(20)
    assert isinstance(tokenized, p.Tokenized) and len(tokenized.pieces) == len(tokenized.tokens) > 1
    assert b"".join(tokenized.pieces[1:]) == b"hello world"  # after the BOS the add_special put first
    assert isinstance(detokenized, p.Detokenized) and detokenized.text.endswith("hello world")
    assert isinstance(refused, p.Failed) and refused.code == "invalid_request" and "1000000" in refused.message
    assert isinstance(finished, p.Finished)
