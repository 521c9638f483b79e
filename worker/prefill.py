"""Prefill: a prompt into the KV cache, chunk by chunk, each chunk checked by the guard.

One request alone (`step`), or a group of requests in one pass per chunk
(`group_step`, worker/group_prefill.py for the MLX mechanics). Around every
chunk the prefill guard (SPEC G1-G3, worker/prefill_guard.py, pure) decides:

- **G1** before the first chunk: does the whole prefill fit on top of the
  group's usage? If not, the worker's own unused prompt-cache entries go
  first (H4), then the supervisor is asked for room (`NeedMemory`, the
  request waits), then the request is refused (`prefill_memory_exceeded`).
- **G2** for every chunk: how many tokens fit under the chunk target; a
  group that cannot give every row a token is split, each request going on
  alone with its KV so far. When not even the floor chunk fits, the same
  steps as G1 (2026-12-05): own unused entries, then the supervisor (the
  request is `held` with its KV so far), then the refusal.
- **G3** after every chunk: over the abort limit the pool is returned and,
  still over, the request (or the group) is refused.

A chunk is also sized by time (`ChunkTimer`): commands wait for the step to
end. The last prompt token's logits give the first output token; the
request is then `decoding` and worker/scheduler.py hands it to the decode
step. Nothing here moves a request between the scheduler's lines: its state
(worker/request.py) says where it goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from shared.limits import Limits
from shared.protocol import NeedMemory, PrefillProgress
from worker import own_memory, prefill_cost
from worker import prefill_guard as guard
from worker import prompt_cache as pc
from worker.endings import Endings, Event, prompted
from worker.group_prefill import PrefillGroup
from worker.own_memory import UsageFn
from worker.request import WAITING_FOR_ROOM, Seq
from worker.sampling import pick_rows

log = logging.getLogger("memvisor.worker.engine")


class DeviceUsage(NamedTuple):
    """A discrete device's pool as the worker sees it (SPEC D1's fallback): the group's
    device bytes (MLX active + pool of every worker, this one fresh) and this worker's own."""

    group: UsageFn
    own: UsageFn


class GuardedPool(NamedTuple):
    """The memory pool a prefill's peak lands in, and the limits G1-G3 hold it to there."""

    limits: Limits
    usage: UsageFn  # the group's usage of the pool
    own: UsageFn    # this worker's part of it (G1: could evicting others help at all?)


DEFAULT_MAX_CHUNK = 512
MEMORY_WAIT_SECONDS = 10.0

# prefill chunks sized by time: a chunk is work the heartbeat cannot interrupt
CHUNK_SECONDS = 0.25    # the time one prefill turn aims at (2026-12-05: 1.0 before fair prefill)
FIRST_CHUNK = 64        # tokens of a chunk before any has been timed
MIN_TIMED_CHUNK = 16    # never fewer per chunk (a chunk has a fixed cost too)
UNTIMED = 1 << 30       # "no bound": a turn's budget with chunks sized by memory only


class ChunkTimer:
    """Sizes prefill chunks so one takes about `seconds`, whatever the machine.

    Commands (abort, reclaim, drain) are obeyed at step boundaries, so a step's
    length is how long they wait. Memory alone sized chunks at 512 tokens, and
    one such chunk of a 300 MiB float16 model took 4.7-12.2 s on a small CPU.
    The per-token time jumps up at once when a chunk is slower (attention
    grows with the prompt) and decays slowly when faster, like the memory
    estimate of G2."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.per_token = 0.0  # seconds per prompt token, 0 until a chunk has been timed

    def cap(self, tokens: int) -> int:
        if self.seconds <= 0:
            return tokens
        if self.per_token <= 0:
            return min(tokens, FIRST_CHUNK)
        return min(tokens, max(MIN_TIMED_CHUNK, int(self.seconds / self.per_token)))

    def learn(self, elapsed: float, tokens: int) -> None:
        if tokens < MIN_TIMED_CHUNK or elapsed <= 0:
            return
        observed = elapsed / tokens
        self.per_token = observed if observed > self.per_token else 0.7 * self.per_token + 0.3 * observed


class Prefill:
    """Runs prefill chunks under G1-G3 and learns what a chunk costs (G2's running estimate)."""

    def __init__(self, model, tokenizer, endings: Endings, *, layers: int, max_chunk: int,
                 chunk_seconds: float, own_usage: UsageFn, reclaim: Callable[[], int],
                 clock: Callable[[], float], memory_wait: float, device: DeviceUsage | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.endings = endings
        self.prompt_cache = endings.prompt_cache
        self.layers = layers
        self.max_chunk = max(1, max_chunk)
        self.cost = prefill_cost.prior_cost(model, self.max_chunk)
        self.chunk_timer = ChunkTimer(chunk_seconds)  # chunks sized by time too
        self.tokens = 0  # prompt tokens run through the model so far
        self._own_usage = own_usage
        self._reclaim = reclaim
        self._clock = clock
        self._memory_wait = memory_wait
        self._device = device  # set when MLX's arrays live on a discrete device (CUDA)
        self.vision: Any = None  # a vision model's worker.vision.VisionPrefill (image requests' tower turn)

    def pool(self, limits: Limits, usage_fn: UsageFn) -> GuardedPool:
        """Where a prefill's peak lands: on a discrete device its KV and activations are device
        memory, so G1-G3 hold them to the device pool's limits (SPEC D) when the
        supervisor guards one; host RAM otherwise, and on a device the supervisor does not see."""
        if self._device is not None and limits.device_hard > 0:
            return GuardedPool(guard.device_limits(limits), self._device.group, self._device.own)
        return GuardedPool(limits, usage_fn, self._own_usage)

    # -- one request ---------------------------------------------------------------------

    def turn_budget(self) -> int:
        """The tokens one prefill turn may run, shared by every request prefilling (worker/scheduler.py):
        what runs in `chunk_seconds` at the last measured pace (ChunkTimer), so a running stream
        waits about that long between two tokens whoever prefills."""
        return self.chunk_timer.cap(UNTIMED)

    def reserved(self, prefilling: list[Seq | PrefillGroup]) -> int:
        """KV bytes the prefills under way will still add (G1 for a request starting beside them):
        their usage is in the reading, the growth still to come is not."""
        total = 0.0
        for item in prefilling:
            if isinstance(item, PrefillGroup):
                total += len(item.live) * (guard.kv_bytes(self.cost, item.length) - guard.kv_bytes(self.cost, item.pos))
            else:
                total += guard.kv_bytes(self.cost, len(item.prompt)) - guard.kv_bytes(self.cost, item.pos)
        return int(total * (1.0 + self.cost.kv_slack))

    def step(self, seq: Seq, limits: Limits, usage_fn: UsageFn, events: list[Event], budget: int, *,
             reserved: int = 0, may_ask: bool = True) -> int:
        """Advance one prefilling request by a chunk of at most `budget` tokens; the tokens run.

        `reserved`: what the other prefills will still grow (G1 counts it);
        `may_ask`: False while another request waits for the supervisor's answer
        (then one that needs room waits, without asking a second time).
        Afterwards its state says where it goes: still `preflight`, `waiting`,
        `prefill` or `held` (it stays in the line), `decoding` (its first token
        is sampled) or `ended` (the guard refused it).
        """
        if seq.state in WAITING_FOR_ROOM:
            if self._clock() < seq.deadline:
                return 0
            seq.retry_after_room()  # no answer came in time: try once more all the same
        pool = self.pool(limits, usage_fn)
        if seq.state == "preflight" and not self._preflight(seq, pool, events, reserved, may_ask):
            return 0
        if seq.media is not None and seq.media.pending(seq.pos):  # an image request's tower: the rest of the turn
            self.vision.run(seq)
            if guard.guard_on(pool.limits):
                self._after_chunk([seq], pool, events)  # G3 after it, as after a chunk (a refusal ends it)
            return max(1, budget)
        remaining = len(seq.prompt) - 1 - seq.pos
        used = 0
        if remaining > 0:
            tokens = self._chunk_tokens(seq, min(remaining, max(1, budget)), pool, events)
            if tokens == 0 or not self._run_chunk(seq, tokens, pool, events):
                return tokens  # refused or held for room (nothing ran), or refused after its chunk
            used = tokens
        if seq.pos == len(seq.prompt) - 1:
            self._first_token(seq)
            used += 1
        return used

    def resume(self, seq: Seq, limits: Limits, usage_fn: UsageFn, events: list[Event], *,
               reserved: int = 0) -> None:
        """A request whose whole prompt but its last token is in the prompt cache (H1): G1, its KV
        forked from the entry, and on to the decode batch with its last prompt token in flight.

        Why not `_first_token`: that is a forward pass of its own for one token, and a burst of
        such requests (the same prompt sent again, retries) took one pass and one prefill turn
        each, so the last of 32 waited for 31 turns. Fed by the decode step, their last prompt
        tokens ride in the pass that decodes everyone else, and the token that pass samples is
        their first; worker/decode.py emits nothing for the prompt token itself.
        Afterwards its state says where it goes, as after `step`.
        """
        if not self._preflight(seq, self.pool(limits, usage_fn), events, reserved, True):
            return
        if seq.pos != len(seq.prompt) - 1:
            return  # the entry no longer covers it all: it prefills the usual way at the head
        seq.y = mx.array(seq.prompt[-1:], dtype=mx.uint32)  # the dtype of sampled tokens
        seq.resuming = True
        self.tokens += 1
        seq.detok = self.tokenizer.detokenizer
        seq.move("first_token")

    def _preflight(self, seq: Seq, pool: GuardedPool, events: list[Event], reserved: int, may_ask: bool) -> bool:
        """G1 (with H4 first); True when the prefill may start now.

        A request that fits only once the prefills beside it are done (`reserved`)
        waits for them in the line, as it waited behind them before they shared
        turns; so does one that needs room while another request asks for it."""
        if self.endings.cacheable:  # look again: a request that finished meanwhile may cover more
            hit = self.prompt_cache.lookup(seq.prompt, len(seq.prompt) - 1, partition=seq.partition)
            self.prompt_cache.release(seq.hit)
            seq.hit = hit
        if not guard.guard_on(pool.limits):
            self._start(seq)
            events.append(prompted(seq))
            return True
        verdict = self.verdict(seq, pool, reserved)
        if verdict.verdict != "fits" and self.prompt_cache.drop_unused():
            self._reclaim()  # H4: our own unused entries go before anyone else's model
            verdict = self.verdict(seq, pool, reserved)
        if verdict.verdict == "fits":
            self._start(seq)
            events.append(prompted(seq))
            return True
        if reserved > 0 or (not may_ask and verdict.verdict == "evict"):
            return False  # it waits for the prefills beside it, or for the answer another one waits for
        self._ask_or_refuse(seq, verdict, pool, events)
        return False

    def _ask_or_refuse(self, seq: Seq, verdict: guard.Preflight, pool: GuardedPool, events: list[Event]) -> None:
        """G1 and G2 alike: `evict` asks the supervisor for room (`NeedMemory`, the shortfall) and the
        request waits for its answer; `reject` refuses it (`prefill_memory_exceeded`)."""
        if verdict.verdict == "evict":
            seq.move("need_memory")
            seq.deadline = self._clock() + self._memory_wait
            events.append(NeedMemory(request_id=seq.id, need_bytes=verdict.need_bytes,
                                     pool="device" if pool.limits.binding == guard.DEVICE else "host"))
            return
        events.append(self.endings.memory_failure(seq, verdict.estimated_bytes, verdict.limit_bytes,
                                                  verdict.binding))

    def verdict(self, seq: Seq, pool: GuardedPool, reserved: int = 0) -> guard.Preflight:
        """G1 for the tokens still to run; a reused prefix costs only its copy (see prompt_cache),
        and the prefills beside it what they will still grow (`reserved`)."""
        reused = seq.hit.tokens if seq.hit is not None else 0
        extra = int(reused * self.cost.kv_per_token) + reserved
        if seq.media is not None:  # an image request: its embeddings and the vision tower's peak too
            text = guard.admission_peak(len(seq.prompt) - reused, self.cost, pool.limits.min_chunk_tokens, done=reused)
            extra += self.vision.extra_bytes(seq, reused, text)
        return guard.preflight(pool.limits, pool.usage(), len(seq.prompt) - reused, self.cost,
                               own_usage=pool.own(), retried=seq.retried, extra_bytes=extra, done=reused)

    def _start(self, seq: Seq) -> None:
        """The request's KV: a fork of its cache hit (H1), else empty."""
        if seq.hit is not None:
            seq.cache = pc.PromptCache.fork(seq.hit)
            seq.cached = seq.pos = seq.hit.tokens
            if seq.hit.entry.from_disk:  # the first request to reuse an entry read from disk says so
                seq.cached_disk, seq.hit.entry.from_disk = seq.hit.tokens, False
            # The fork is a copy: from here on the entry is not in use (H3 may drop it).
            self.prompt_cache.release(seq.hit)
            seq.hit = None
        else:
            seq.cache = make_prompt_cache(self.model)
        seq.move("start")

    def _chunk_tokens(self, seq: Seq, remaining: int, pool: GuardedPool, events: list[Event]) -> int:
        """G2: the next chunk's tokens, `remaining` being what the turn's budget leaves it; 0 when
        not even the floor chunk fits, and the request is then held for room or refused
        (`_room_for_floor`)."""
        if not guard.guard_on(pool.limits):
            return min(self.max_chunk, remaining)
        tokens = self._plan(seq, remaining, pool, pool.usage()).tokens
        if tokens == 0:
            tokens = self._room_for_floor(seq, remaining, pool, events)
        return tokens

    def _plan(self, seq: Seq, remaining: int, pool: GuardedPool, usage: int) -> guard.ChunkPlan:
        return guard.next_chunk(pool.limits, usage, remaining, self.cost, self.max_chunk, done=seq.pos)

    def _room_for_floor(self, seq: Seq, remaining: int, pool: GuardedPool, events: list[Event]) -> int:
        """G2 (2026-12-05) when not even the floor chunk fits, as G1: this worker's unused prompt-cache
        entries go first (H4); then the supervisor is asked for room once (the request is `held`
        with its KV so far, and retries with the answer); only then is it refused. The tokens
        that fit once the entries went, else 0."""
        if self.prompt_cache.drop_unused():
            self._reclaim()
        usage = pool.usage()
        plan = self._plan(seq, remaining, pool, usage)
        if plan.tokens:
            return plan.tokens
        self._ask_or_refuse(seq, guard.floor_room(plan, usage, pool.own(), retried=seq.floor_retried), pool, events)
        return 0

    def _run_chunk(self, seq: Seq, n: int, pool: GuardedPool, events: list[Event]) -> bool:
        """Run `n` tokens (G2 sized them), measure, G3 check; False when the request was refused."""
        guarded = guard.guard_on(pool.limits)
        chunk = mx.array(seq.prompt[seq.pos:seq.pos + n])[None]
        own_memory.reset_peak()
        before = mx.get_active_memory()
        started = time.monotonic()
        with mx.stream(generation_stream):
            self.model(chunk, cache=seq.cache, **(seq.media.inputs(seq.pos, n) if seq.media is not None else {}))
            mx.eval([c.state for c in seq.kv()])
        self.chunk_timer.learn(time.monotonic() - started, n)
        self.cost = prefill_cost.learn(self.cost, mx.get_peak_memory() - before, n, done=seq.pos)
        seq.pos += n
        self.tokens += n
        mx.clear_cache()  # as mlx_lm does after every chunk: transient buffers go back
        if seq.pos < len(seq.prompt) - 1:  # more chunks to come: the waiting client hears how far (one line each)
            events.append(PrefillProgress(request_id=seq.id, done=seq.pos, total=len(seq.prompt)))
        return not guarded or self._after_chunk([seq], pool, events)

    def _after_chunk(self, seqs: list[Seq], pool: GuardedPool, events: list[Event]) -> bool:
        """G3 for a request or a group: over the abort limit reclaim and re-check; still over
        refuses them all. False when they were refused."""
        limits = pool.limits
        level = guard.after_chunk(limits, pool.usage())
        if level == "over_abort":
            self._reclaim()
            usage = pool.usage()
            if guard.after_chunk(limits, usage) == "over_abort":
                for seq in seqs:
                    events.append(self.endings.memory_failure(seq, usage, limits.abort_limit,
                                                              guard.abort_binding(limits)))
                return False
        elif level == "over_soft":
            for seq in seqs:
                if not seq.warned_soft:
                    seq.warned_soft = True
                    log.info("request %s: prefill is above the soft limit", seq.id)
        return True

    def _first_token(self, seq: Seq) -> None:
        """Feed the last prompt token; its sampled successor is the first output token."""
        last = mx.array(seq.prompt[-1:])[None]
        with mx.stream(generation_stream):
            logits = self.model(last, cache=seq.cache)[:, -1, :]
            if seq.constraint is not None:
                logits = seq.constraint.mask(logits)
            seq.y = seq.sample(logits)
        mx.async_eval(seq.y)
        self.tokens += 1
        seq.detok = self.tokenizer.detokenizer
        seq.move("first_token")

    # -- a group ------------------------------------------------------------------------

    def fits(self, seq: Seq, limits: Limits, usage_fn: UsageFn, *, reserved: int = 0) -> bool:
        """G1 for one would-be member of a group."""
        return self.verdict(seq, self.pool(limits, usage_fn), reserved).verdict == "fits"

    def group_fits(self, members: list[Seq], limits: Limits, usage_fn: UsageFn, *, reserved: int = 0) -> bool:
        """G1 for the group: usage plus the sum of each member's estimate, its KV padded to the
        longest; and G2's view of the group's first step (one column each) under the chunk target,
        since a group that cannot take its first step would only be split again."""
        pool = self.pool(limits, usage_fn)
        limits, usage = pool.limits, pool.usage()
        limit, target = guard.prefill_limit(limits), guard.chunk_target(limits)
        padded = max(len(seq.prompt) for seq in members)
        peak = sum(guard.admission_peak(padded, self.cost, limits.min_chunk_tokens) for _ in members)
        first = len(members) * guard.padded_chunk_bytes(self.cost, 0, 1)
        return ((limit.bytes == 0 or usage + reserved + peak <= limit.bytes)
                and (target.bytes == 0 or usage + first <= target.bytes))

    def group_step(self, group: PrefillGroup, limits: Limits, usage_fn: UsageFn, events: list[Event],
                   budget: int) -> int:
        """One chunk of columns for every row within `budget` tokens (G2 for the group's tokens, G3
        after), and the first tokens once the prompts are in; the tokens run (padding included).

        Afterwards the members' states say where they go: all still `grouped`,
        all `prefill` (split: each goes on alone), all `decoding`, or all `ended`.
        """
        rows = len(group)
        pool = self.pool(limits, usage_fn)
        used = 0
        if group.remaining > 0:
            columns = min(group.remaining, max(1, min(self.max_chunk, budget) // rows))
            guarded = guard.guard_on(pool.limits)
            if guarded:
                columns = self._group_columns(group, pool.limits, pool.usage(), columns)
                if columns == 0:
                    self._split(group)  # a step for the group does not fit: each goes on alone (G2)
                    return 0
            done = group.pos
            real = group.real_tokens(columns)
            own_memory.reset_peak()
            before = mx.get_active_memory()
            started = time.monotonic()
            group.run_chunk(self.model, columns)
            self.chunk_timer.learn(time.monotonic() - started, columns * rows)
            # the rows are alike (same columns on the same positions): each grew the peak by its share
            self.cost = prefill_cost.learn(self.cost, (mx.get_peak_memory() - before) // rows, columns, done=done)
            self.tokens += real
            mx.clear_cache()
            used = columns * rows
            if guarded and not self._after_chunk(group.live, pool, events):
                return used
            if group.remaining > 0:
                return used
        self._group_first_tokens(group)
        return used + len(group.live)

    def _group_columns(self, group: PrefillGroup, limits: Limits, usage: int, columns: int) -> int:
        """G2 for the group: G2's plan for one row, then as many columns as fit for every row
        (the group's chunk is its rows' padded chunk costs summed); 0 when not one column fits."""
        rows = len(group)
        plan = guard.next_chunk(limits, usage, group.remaining, self.cost, columns, done=group.pos)
        target = guard.chunk_target(limits).bytes
        columns = min(columns, plan.tokens)
        while target and columns > 0 and usage + rows * guard.padded_chunk_bytes(self.cost, group.pos, columns) > target:
            columns //= 2
        return columns

    def _split(self, group: PrefillGroup) -> None:
        """Each live member with its own KV so far, to go on alone."""
        for seq, layers, held in group.split():
            seq.cache = layers if layers is not None else make_prompt_cache(self.model)
            seq.pos = held
            seq.move("split")

    def _group_first_tokens(self, group: PrefillGroup) -> None:
        """Every row's last prompt token in one pass: the first tokens; each row's KV a view of the
        group's buffers, which the decode batch copies in when the row joins."""
        live = [(i, seq) for i, seq in enumerate(group.rows) if seq is not None]
        with mx.stream(generation_stream):
            logits = group.last_logits(self.model)
            for i, seq in live:
                if seq.constraint is not None:
                    seq.y = seq.sample(seq.constraint.mask(logits[i:i + 1]))
            # the free rows in as few picks as their settings allow (worker/sampling.py)
            for rows, tokens in pick_rows([(i, seq.sample) for i, seq in live if seq.constraint is None], logits):
                for j, i in enumerate(rows):
                    group_seq = group.rows[i]
                    assert group_seq is not None  # a live row
                    group_seq.y = tokens[j:j + 1]
        mx.async_eval([seq.y for _, seq in live])
        self.tokens += len(live)
        for i, seq in live:
            seq.cache = group.row_kv(i)
            seq.detok = self.tokenizer.detokenizer
            seq.move("first_token")
