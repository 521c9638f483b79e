"""Who runs this step: where every request is, and which work goes next.

A request is in exactly one of the scheduler's lines, and its state
(worker/request.py) matches the line:

    queue      queued                          submitted, not yet admitted
    line       preflight, waiting, prefill,    prefilling alone (several at once)
               held
    group      grouped                         prefilled together
    decoding   decoding                        a token each step (the decode batch)

**Admission** (SPEC P3, P8) moves requests from the queue to the prefill line
while fewer than the concurrency cap run; while the supervisor pauses
admission, one is taken only when nothing runs.

**The turn.** A step is short, because the supervisor's commands (new
limits, reclaim, abort) take effect between steps: it is EITHER a prefill
turn OR one decode token for every decoding request. When both kinds of work
wait they alternate, so a running stream waits at most one prefill turn
between two tokens. A prefill turn that ran nothing (everyone waits for the
supervisor's memory answer, or the guard refused them) leaves the turn to decode.

**Fair prefill** (2026-12-05). A prefill turn has a token budget: the tokens
the prefill runs in `chunk_seconds` (worker/prefill.py `Prefill.turn_budget`),
shared by every request that is prefilling, not given to the first in line
alone. Before, the head of the line took whole turns until its prompt was
done: a 6,969-token prompt held a 117-token one behind it for 252.8 s. Now
each turn walks the prefilling requests in `PrefillOrder`:

- `shortest` (the default): the request with the fewest tokens still to run
  first, then the next, while the budget lasts. A short prompt's first token
  waits for at most the turn in flight and its own tokens, never for a long
  prompt's whole prefill; the long one loses only the short one's work
  (scripts/bench_fairness.py measured both orders).

A turn that made a first token ends there when what is left of its budget
would go to a request that cannot reach its own first token in it: the
events of a step leave together at its end, so the rest of the turn would
only hold the new first token back (the short prompt's wait was the turn in
flight, its own tokens and then the long prompt's share of its turn). The
long prompt gets that share at its next turn. Requests that all finish in
the budget still share one turn.
- `round_robin`: the budget in equal shares, everyone a chunk each turn.

Each chunk is still sized by G2 and checked by G3 on its own, with the usage
read before it (which holds every chunk run before it in the turn), so the
turn as a whole stays under the chunk target; and G1 for a request that
starts while others prefill counts the KV they are still to grow
(`Prefill.reserved`). While one request waits for the supervisor's memory
answer, no new prefill starts (one request for room at a time); those already
prefilling go on.

**Grouping**: fresh requests waiting together in the line are prefilled
together when each fits G1 alone and the group fits as a sum (worker/prefill.py
asks the guard); the first of them that fits is always a member.

The prefill and decode rooms never move a request between lines: after they
ran, the request's state says where it goes, and the moves are all here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Union

from shared.limits import Limits
from shared.vocab import PrefillOrder
from worker import prefill_guard as guard
from worker.decode import DecodeStep
from worker.endings import Endings, Event, prompted
from worker.group_prefill import PrefillGroup, worth_padding
from worker.own_memory import UsageFn
from worker.prefill import Prefill
from worker.request import WAITING_FOR_ROOM, Seq

Work = Union[Seq, PrefillGroup]  # what a prefill turn advances: a request alone, or the group


class Scheduler:
    """The lines, admission, the prefill/decode turn, the prefill budget and grouping."""

    def __init__(self, prefill: Prefill, decode: DecodeStep, endings: Endings, *,
                 max_concurrency: int, clock: Callable[[], float], order: PrefillOrder = "shortest") -> None:
        self.prefill = prefill
        self.decode = decode
        self.endings = endings
        self.max_concurrency = max(1, max_concurrency)
        self.order: PrefillOrder = order
        self.queue: deque[Seq] = deque()
        self.line: deque[Seq] = deque()
        self.group: PrefillGroup | None = None
        self.decoding: list[Seq] = []
        self._prefill_turn = True
        self._clock = clock
        self._rotation = 0  # round robin: who goes first this turn

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
            # While a request waits for the supervisor's answer no new prefill starts,
            # and admitting more would not move anything either.
            return any(self._movable(seq) for seq in self.line)
        return bool(self.queue)

    def _room_wait(self) -> bool:
        """True while a request waits for the supervisor's answer (no new prefill starts)."""
        return any(seq.state in WAITING_FOR_ROOM for seq in self.line)

    def _movable(self, seq: Seq) -> bool:
        if seq.state in WAITING_FOR_ROOM:
            return self._clock() >= seq.deadline
        return seq.state != "preflight" or not self._room_wait()

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
        """Admit what the limits allow, then run one prefill turn or one decode token each."""
        self._admit(limits)
        if (self.line or self.group is not None) and (self._prefill_turn or not self.decoding):
            if self._prefill_step(limits, usage_fn, events):
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

    def _prefill_step(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> bool:
        """One prefill turn: the budget shared by the group and the prefilling requests in
        `order`; True when it ran anything (a chunk, a first token, a refusal)."""
        if self.decode.batched:
            self._resume_hits(limits, usage_fn, events)
            if self.group is None and self.line and not self._room_wait():
                self.group = self._form_group(limits, usage_fn)
                if self.group is not None:  # a member's prompt is final (none reuses the cache)
                    events.extend(prompted(seq) for seq in self.group.live)
        budget = whole = self.prefill.turn_budget()
        work = self._turn_order()
        ran = False
        for i, item in enumerate(work):
            if budget <= 0:
                break
            if budget < whole and _tower_pending(item):
                continue  # an image's tower is not in its token count: it takes a turn of its own
            share = budget if self.order == "shortest" else max(1, -(-budget // (len(work) - i)))
            used, moved = self._advance(item, share, limits, usage_fn, events)
            budget -= used
            ran = ran or used > 0 or moved
            if moved and _made_first_token(item) and i + 1 < len(work) and self._to_run(work[i + 1]) > budget:
                break  # its first token leaves now, not after a chunk that makes nobody's (module docstring)
        return ran

    def _turn_order(self) -> list[Work]:
        """The group and the line's movable requests, in the order this turn serves them."""
        work: list[Work] = [seq for seq in self.line if self._movable(seq)]
        if self.group is not None:
            work.insert(0, self.group)
        if self.order == "shortest":
            return sorted(work, key=self._to_run)  # stable: equal ones keep their line order
        if work:
            self._rotation = (self._rotation + 1) % len(work)
            work = work[self._rotation:] + work[:self._rotation]
        return work

    def _to_run(self, item: Work) -> int:
        """Tokens still to run before `item`'s first token (a group: over all its rows)."""
        if isinstance(item, PrefillGroup):
            return (item.remaining + 1) * len(item.live)
        cached = item.hit.tokens if item.state == "preflight" and item.hit is not None else 0
        return len(item.prompt) - max(item.pos, cached)

    def _advance(self, item: Work, budget: int, limits: Limits, usage_fn: UsageFn,
                 events: list[Event]) -> tuple[int, bool]:
        """One chunk of `item` within `budget` tokens: (tokens run, whether it moved on: ended,
        split or done). MLX raising fails the requests involved, not the worker."""
        reserved = self.prefill.reserved(self._prefilling(besides=item))
        try:
            if isinstance(item, PrefillGroup):
                used = self.prefill.group_step(item, limits, usage_fn, events, budget)
                moved = self._after_group(item)
                return used, moved
            state = item.state
            used = self.prefill.step(item, limits, usage_fn, events, budget, reserved=reserved,
                                     may_ask=not self._room_wait())
        except Exception as exc:  # noqa: BLE001 - the requests involved fail, the worker lives
            self._fail(item, exc, events)
            return 0, True
        if item.state in ("decoding", "ended"):
            self.line.remove(item)
            if item.state == "decoding":
                self._start_decoding(item)
        return used, item.state != state

    def _fail(self, item: Work, exc: Exception, events: list[Event]) -> None:
        if isinstance(item, PrefillGroup):
            failed = item.live
            if self.group is item:
                self.group = None
        else:
            failed = [item]
            if item in self.line:
                self.line.remove(item)
        self.endings.engine_failure(failed, exc, events)

    def _prefilling(self, besides: Work | None = None) -> list[Work]:
        """The group and the requests whose prefill has started (their KV still grows)."""
        work: list[Work] = [seq for seq in self.line if seq is not besides and seq.state in ("prefill", "held")]
        if self.group is not None and self.group is not besides:
            work.append(self.group)
        return work

    def _resume_hits(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> None:
        """The requests in the line whose whole prompt but the last token is cached go to the
        decode batch without a prefill turn of their own (Prefill.resume), in line order."""
        for seq in list(self.line):
            if seq.state != "preflight" or seq.hit is None or seq.hit.tokens != len(seq.prompt) - 1:
                continue
            if self._room_wait():
                return
            self.prefill.resume(seq, limits, usage_fn, events,
                                reserved=self.prefill.reserved(self._prefilling()))
            if seq.state in ("decoding", "ended"):
                self.line.remove(seq)
                if seq.state == "decoding":
                    self._start_decoding(seq)

    def _after_group(self, group: PrefillGroup) -> bool:
        """Where the group's members go after its step (their states say it); True when they moved."""
        live = group.live
        if any(seq.state == "grouped" for seq in live):
            return False
        if self.group is group:
            self.group = None
        for seq in reversed(live):
            if seq.state == "prefill":  # split: back at the front of the line, in their order
                self.line.appendleft(seq)
        for seq in live:
            if seq.state == "decoding":
                self._start_decoding(seq)
        return True

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
        """The fresh requests of the prefill line to prefill in one pass, or None.

        A member has not started, reuses no prompt-cache entry (a fork is its
        own KV), fits G1 alone, and does not make the group mostly padding; the
        group must fit G1 as the sum of its members' estimates (on top of the KV
        the requests prefilling beside it will still grow), else it loses
        members from the back. The first fresh request that fits is always a
        member; with fewer than two members each goes alone.
        """
        # An image request prefills alone: its embeddings, not token columns.
        fresh = [seq for seq in self.line if seq.state == "preflight" and seq.hit is None and seq.media is None]
        if len(fresh) < 2:
            return None  # alone: no usage read here, the usual path reads it (G1 once)
        guarded = guard.guard_on(limits)
        reserved = self.prefill.reserved(self._prefilling())
        members: list[Seq] = []
        for seq in fresh:
            if len(members) >= self.prefill.max_chunk:
                break
            if members and not worth_padding([len(m.prompt) for m in members], len(seq.prompt)):
                continue
            if guarded and not self.prefill.fits(seq, limits, usage_fn, reserved=reserved):
                continue  # its own G1 (NeedMemory, reject) goes the usual way, in its own turn
            members.append(seq)
        if guarded:
            while len(members) > 1 and not self.prefill.group_fits(members, limits, usage_fn, reserved=reserved):
                members.pop()
        if len(members) < 2:
            return None
        for seq in members:
            self.line.remove(seq)
            seq.move("group")
        return PrefillGroup(members, [seq.prompt for seq in members], self.prefill.layers)


def _made_first_token(item: Work) -> bool:
    """Whether `item`'s prefill ended in this turn (a first token, or an end): it left the line."""
    if isinstance(item, PrefillGroup):
        return any(seq.state in ("decoding", "ended") for seq in item.live)
    return item.state in ("decoding", "ended")


def _tower_pending(item: Work) -> bool:
    """Whether `item` is an image request whose vision tower runs in its next prefill step
    (worker/vision.py): a request behind it would wait for the whole tower, which the
    turn's token budget does not see."""
    return isinstance(item, Seq) and item.media is not None and item.media.pending(item.pos)

