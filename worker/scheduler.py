"""Who runs this step: where every request is, and which work goes next.

A request is in exactly one of the scheduler's lines, and its state
(worker/request.py) matches the line:

    queue      queued                          submitted, not yet admitted
    line       preflight, waiting, prefill,    the prefill line (only its head moves)
               held
    group      grouped                         prefilled together
    decoding   decoding                        a token each step (the decode batch)

**Admission** (SPEC P3, P8) moves requests from the queue to the prefill line
while fewer than the concurrency cap run; while the supervisor pauses
admission, one is taken only when nothing runs.

**The turn.** A step is short, because the supervisor's commands (new
limits, reclaim, abort) take effect between steps: it is EITHER one prefill
chunk (of the head of the line, or of the group) OR one decode token for
every decoding request. When both kinds of work wait they alternate, so a
long prompt never stalls the streams already running. A prefill turn that
ran nothing (the head waits for the supervisor's memory answer, or the guard
refused it) leaves the turn to decode.

**Grouping**: requests waiting together at the front of the line
are prefilled together when each fits G1 alone and the group fits as a sum
(worker/prefill.py asks the guard); the head of the line is always a member,
so nobody is passed over.

The prefill and decode rooms never move a request between lines: after they
ran, the request's state says where it goes, and the moves are all here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from shared.limits import Limits
from worker import prefill_guard as guard
from worker.decode import DecodeStep
from worker.endings import Endings, Event, prompted
from worker.group_prefill import PrefillGroup, worth_padding
from worker.memory import UsageFn
from worker.prefill import Prefill
from worker.request import WAITING_FOR_ROOM, Seq


class Scheduler:
    """The lines, admission, the prefill/decode turn and grouping."""

    def __init__(self, prefill: Prefill, decode: DecodeStep, endings: Endings, *,
                 max_concurrency: int, clock: Callable[[], float]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.endings = endings
        self.max_concurrency = max(1, max_concurrency)
        self.queue: deque[Seq] = deque()
        self.line: deque[Seq] = deque()
        self.group: PrefillGroup | None = None
        self.decoding: list[Seq] = []
        self._prefill_turn = True
        self._last_turn: Seq | None = None  # who had the last turn while an image request led the line
        self._clock = clock

    # -- where requests are ------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self.line) + len(self.grouped) + len(self.decoding)

    @property
    def grouped(self) -> list[Seq]:
        return self.group.live if self.group is not None else []

    @property
    def has_work(self) -> bool:
        """False when `step()` would do nothing (the worker loop may then block on its sockets)."""
        if self.decoding or self.group is not None:
            return True
        if self.line:
            # Only the head of the prefill line can move; while it waits for the
            # supervisor's answer, admitting more would not move anything either.
            head = self.line[0]
            return head.state not in WAITING_FOR_ROOM or self._clock() >= head.deadline
        return bool(self.queue)

    def next_deadline(self) -> float | None:
        """Earliest time a request waiting for memory retries on its own (loop timeouts)."""
        deadlines = [seq.deadline for seq in self.line if seq.state in WAITING_FOR_ROOM]
        return min(deadlines) if deadlines else None

    def remove(self, request_id: str) -> Seq | None:
        """Take one request out of whichever line holds it (an abort); None for an unknown id."""
        for line in (self.queue, self.line):
            for seq in line:
                if seq.id == request_id:
                    line.remove(seq)
                    return seq
        group = self.group
        if group is not None:
            for i, seq in enumerate(group.rows):
                if seq is not None and seq.id == request_id:
                    group.rows[i] = None  # its row is still computed; nobody else's KV moves
                    if not group.live:
                        self.group = None
                    return seq
        for seq in self.decoding:
            if seq.id == request_id:
                self.decoding.remove(seq)
                self.decode.leave(seq)
                return seq
        return None

    def remove_all(self) -> list[Seq]:
        """Every request, queued ones included, out of every line."""
        seqs = [*self.queue, *self.line, *self.grouped, *self.decoding]
        self.group = None
        self.queue.clear()
        self.line.clear()
        self.decoding.clear()
        self.decode.clear()
        return seqs

    def remove_queued(self) -> list[Seq]:
        """The requests not yet admitted."""
        seqs = list(self.queue)
        self.queue.clear()
        return seqs

    def memory_answer(self, request_id: str) -> bool:
        """G1, G2: the supervisor answered a request waiting for room; it retries once. False if none waits."""
        for seq in self.line:
            if seq.id == request_id and seq.state in WAITING_FOR_ROOM:
                seq.retry_after_room()
                return True
        return False

    # -- the step ----------------------------------------------------------------------

    def step(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> None:
        """Admit what the limits allow, then run one prefill chunk or one decode token each."""
        self._admit(limits)
        if (self.line or self.group is not None) and (self._prefill_turn or not self.decoding):
            if self._prefill_turn_ran(limits, usage_fn, events):
                self._prefill_turn = False
                return
        if self.decoding:
            self._decode_turn(events)
            self._prefill_turn = True

    def _admit(self, limits: Limits) -> None:
        """SPEC P8 cap; P3: while paused, take one only when nothing runs."""
        cap = min(self.max_concurrency, max(1, limits.max_concurrency))
        while self.queue and self.running < cap:
            if limits.admission_paused and self.running > 0:
                return
            seq = self.queue.popleft()
            seq.move("admit")
            self.line.append(seq)

    def _prefill_turn_ran(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> bool:
        """The prefill turn; True when it used the step. MLX raising fails the requests involved."""
        try:
            return self._prefill_step(limits, usage_fn, events)
        except Exception as exc:  # noqa: BLE001 - the requests involved fail, the worker lives
            if self.group is not None:
                failed, self.group = self.group.live, None
            else:
                failed = [self.line.popleft()]
            self.endings.engine_failure(failed, exc, events)
            return True

    def _prefill_step(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> bool:
        """Advance the prefill group, else the head of the prefill line; True when a chunk ran."""
        if self.group is None and self.decode.batched:
            self._resume_hits(limits, usage_fn, events)
            if not self.line:
                return False  # they join the decode step of this very turn
            self.group = self._form_group(limits, usage_fn)
            if self.group is not None:  # a member's prompt is final (none reuses the cache)
                events.extend(prompted(seq) for seq in self.group.live)
        if self.group is not None:
            self.prefill.group_step(self.group, limits, usage_fn, events)
            self._after_group(self.group)
            return True
        seq = self._next_in_line()
        ran = self.prefill.step(seq, limits, usage_fn, events)
        if seq.state in ("decoding", "ended"):
            self.line.remove(seq)
            if seq.state == "decoding":
                self._start_decoding(seq)
        return ran

    def _next_in_line(self) -> Seq:
        """The head of the prefill line; while the head is an image request, the request behind it
        takes every other prefill turn. Why: an image's prefill is its tower and then hundreds to
        thousands of image tokens, and the tower's work is not in the prompt's token count: a short
        request behind it waited 2.7 times as long as behind a text prompt of the same token count
        (scripts/bench_vision.py). A request waiting for the supervisor's room keeps its place."""
        head = self.line[0]
        if head.media is None or len(self.line) < 2:
            return head
        second = self.line[1]
        yields = self._last_turn is head or head.state == "preflight"  # the one behind goes first
        self._last_turn = second if yields and second.state not in WAITING_FOR_ROOM else head
        return self._last_turn

    def _resume_hits(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> None:
        """The requests at the front of the line whose whole prompt but the last token is cached
        go to the decode batch without a prefill turn of their own (Prefill.resume), in order,
        until one is not such a request or has to wait for memory."""
        while self.line:
            seq = self.line[0]
            if seq.state != "preflight" or seq.hit is None or seq.hit.tokens != len(seq.prompt) - 1:
                return
            self.prefill.resume(seq, limits, usage_fn, events)
            if seq.state not in ("decoding", "ended"):
                return  # waiting for memory, or prefilling after all: it is the head now
            self.line.popleft()
            if seq.state == "decoding":
                self._start_decoding(seq)

    def _after_group(self, group: PrefillGroup) -> None:
        """Where the group's members go after its step (their states say it)."""
        live = group.live
        if any(seq.state == "grouped" for seq in live):
            return
        self.group = None
        for seq in reversed(live):
            if seq.state == "prefill":  # split: back at the front of the line, in their order
                self.line.appendleft(seq)
        for seq in live:
            if seq.state == "decoding":
                self._start_decoding(seq)

    def _start_decoding(self, seq: Seq) -> None:
        self.decoding.append(seq)
        self.decode.join(seq)  # it joins the batch at the next decode step

    def _decode_turn(self, events: list[Event]) -> None:
        """One token for every decoding request; MLX raising fails them all, the worker lives."""
        try:
            self.decoding = self.decode.run(self.decoding, events)
        except Exception as exc:  # noqa: BLE001
            alive, self.decoding = self.decoding, []
            self.decode.clear()
            self.endings.engine_failure(alive, exc, events)

    # -- grouping ----------------------------------------------------------------------

    def _form_group(self, limits: Limits, usage_fn: UsageFn) -> PrefillGroup | None:
        """The requests at the front of the prefill line to prefill in one pass, or None.

        A member has not started, reuses no prompt-cache entry (a fork is its
        own KV), fits G1 alone, and does not make the group mostly padding; the
        group must fit G1 as the sum of its members' estimates, else it loses
        members from the back. The head of the line is always a member, so no
        request is passed over; with fewer than two members the head goes alone.
        """
        head = self.line[0]
        if head.state != "preflight" or head.hit is not None or head.media is not None:
            return None
        if sum(1 for seq in self.line if seq.state == "preflight" and seq.hit is None) < 2:
            return None  # alone: no usage read here, the usual path reads it (G1 once)
        guarded = guard.guard_on(limits)
        members: list[Seq] = []
        for seq in self.line:
            if len(members) >= self.prefill.max_chunk:
                break
            if seq.state != "preflight" or seq.hit is not None or seq.media is not None:
                continue  # an image request prefills alone (its embeddings, not token columns)
            if members and not worth_padding([len(m.prompt) for m in members], len(seq.prompt)):
                continue
            if guarded and not self.prefill.fits(seq, limits, usage_fn):
                if seq is head:
                    return None  # the head's own G1 (NeedMemory, reject) goes the usual way
                continue
            members.append(seq)
        if guarded:
            while len(members) > 1 and not self.prefill.group_fits(members, limits, usage_fn):
                members.pop()
        if len(members) < 2:
            return None
        for seq in members:
            self.line.remove(seq)
            seq.move("group")
        return PrefillGroup(members, [seq.prompt for seq in members], self.prefill.layers)
