"""worker/frames.py: which of a step's events leave at once and which tokens wait for the next ones."""

from __future__ import annotations

from shared import protocol as p
from worker.frames import Frames


def tok(rid: str, i: int) -> p.TokenOut:
    return p.TokenOut(request_id=rid, text=f"{rid}{i}", token_id=i)


def flat(frames: list[p.Msg]) -> list[p.Msg]:
    """The frames as the supervisor delivers them: a TokenBatch's rows in order."""
    out: list[p.Msg] = []
    for msg in frames:
        out.extend(msg.tokens() if isinstance(msg, p.TokenBatch) else [msg])
    return out


def test_a_requests_first_token_leaves_at_once():
    frames = Frames(interval=10.0)
    assert frames.after_step([tok("a", 0)], now=1.0, steady=True) == [tok("a", 0)]


def test_tokens_of_flowing_streams_wait_then_leave_in_one_frame_in_order():
    frames = Frames(interval=0.005)
    frames.after_step([tok("a", 0), tok("b", 0)], now=1.0, steady=True)
    assert frames.after_step([tok("a", 1), tok("b", 1)], now=1.001, steady=True) == []
    assert frames.after_step([tok("a", 2), tok("b", 2)], now=1.002, steady=True) == []
    out = frames.after_step([tok("a", 3), tok("b", 3)], now=1.006, steady=True)
    assert len(out) == 1 and isinstance(out[0], p.TokenBatch)
    assert flat(out) == [tok(r, i) for i in (1, 2, 3) for r in ("a", "b")]


def test_an_ending_takes_the_held_tokens_with_it_before_it():
    frames = Frames(interval=10.0)
    frames.after_step([tok("a", 0)], now=1.0, steady=True)
    frames.after_step([tok("a", 1)], now=1.0, steady=True)
    end = p.Finished(request_id="a", finish_reason="length", prompt_tokens=3, completion_tokens=3)
    assert flat(frames.after_step([tok("a", 2), end], now=1.0, steady=False)) == [tok("a", 1), tok("a", 2), end]
    # its id is free again: a new request of that id has a first token that leaves at once
    assert frames.after_step([tok("a", 0)], now=1.0, steady=True) == [tok("a", 0)]


def test_any_event_that_is_not_a_flowing_token_leaves_at_once_with_what_was_held():
    frames = Frames(interval=10.0)
    frames.after_step([tok("a", 0)], now=1.0, steady=True)
    frames.after_step([tok("a", 1)], now=1.0, steady=True)
    prompted = p.Prompted(request_id="b", prompt_tokens=5, cached_tokens=0)
    assert flat(frames.after_step([prompted], now=1.0, steady=True)) == [tok("a", 1), prompted]


def test_nothing_is_held_when_the_next_step_is_not_another_decode_step():
    frames = Frames(interval=10.0)
    frames.after_step([tok("a", 0)], now=1.0, steady=True)
    assert frames.after_step([tok("a", 1)], now=1.0, steady=False) == [tok("a", 1)]
    assert frames.after_step([tok("a", 2)], now=1.0, steady=True) == []
    assert frames.flush(now=1.0) == [tok("a", 2)] and frames.held == []
