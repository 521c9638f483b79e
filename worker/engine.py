"""One model, many sequences, advanced one step at a time.

The worker's main loop owns the sockets and the ledger; it calls `step()` in a
loop and forwards the events it returns. Nothing here talks to a socket or
decides policy: limits arrive as a `shared.limits.Limits` the loop reads from
the ledger, and the group's memory usage through a `usage_fn` callback.

Why steps: the supervisor's commands (new limits, reclaim, abort) must take
effect at a step boundary, and a step is short: EITHER one prefill chunk of
one request OR one decode token for every running sequence. When both kinds
of work wait, they alternate, so a long prompt never stalls the streams that
are already running.

Why batches (issue 11): every decoding sequence is a row of one
batched KV cache and advances in the same forward pass (worker/batch.py);
sequences join after their prefill and leave between steps, each copying
only its own row (issue 22). Requests that wait together at the front of
the prefill line are prefilled together in one pass per chunk
(worker/group_prefill.py), the guard checking each and their sum.

Why per-token care: a benchmark holds the whole path (engine + ZeroMQ + HTTP)
to 90% of plain `mlx_lm` throughput. The decode step keeps mlx_lm's one-ahead
pipelining (the next token is queued with `mx.async_eval` before the current
one is read), greedy sampling skips the log-softmax, and events are the wire
Structs themselves so the loop encodes them without copying.

Request life: queued -> admitted (prefill line) -> [waiting for memory] ->
prefilling -> decoding -> finished | failed. Every submitted request ends with
exactly one terminal event (`Finished` or `Failed`), and every event leaves
through `step()`: terminal events of aborts and refused submissions wait in
an outbox that the next `step()` returns first, so the loop has one place to
forward from.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Union, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, make_prompt_cache

from shared.limits import Limits
from shared.modelinfo import context_length
from shared.protocol import Constraint as ConstraintSpec
from shared.protocol import Failed, Finished, Generate, NeedMemory, Prompted, TokenOut
from shared.weights import WeightsError, estimate_weight_bytes
from worker import memory, prefill_cost, prompts
from worker import prefill_guard as guard
from worker import prompt_cache as pc
from worker.batch import DecodeBatch
from worker.constrain import Constraint, ConstraintError, ConstraintFactory
from worker.group_prefill import PrefillGroup, worth_padding
from worker.request import CONTEXT_EXCEEDED, ENGINE_ERROR, INVALID_REQUEST, EngineError, Seq
from worker.sampling import greedy, make_request_sampler
from worker.stops import StopMatcher

log = logging.getLogger("memvisor.worker.engine")

Event = Union[TokenOut, Finished, Failed, NeedMemory, Prompted]
UsageFn = Callable[[], int]


DEFAULT_MAX_CHUNK = 512
CLEAR_CACHE_EVERY = 256  # decode steps between pool returns, as mlx_lm does
MEMORY_WAIT_SECONDS = 10.0
MIN_REUSE_TOKENS = 16  # a shorter shared prefix (BOS, a template's first tokens) is no cache hit
def _guard_on(limits: Limits) -> bool:
    return limits.hard_limit > 0 or limits.abort_limit > 0 or limits.soft_limit > 0


# -- issue 16: prefill chunks sized by time ---------------------------------------
CHUNK_SECONDS = 1.0     # the time one prefill chunk aims at
FIRST_CHUNK = 64        # tokens of a chunk before any has been timed
MIN_TIMED_CHUNK = 16    # never fewer per chunk (a chunk has a fixed cost too)


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
# -- end issue 16 ------------------------------------------------------------------


class Engine:
    """Continuous generation for one loaded model (see module doc)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        weight_bytes: int = 0,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        max_concurrency: int = 64,
        own_usage_fn: UsageFn | None = None,
        reclaim_fn: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        memory_wait: float = MEMORY_WAIT_SECONDS,
        chunk_seconds: float = CHUNK_SECONDS,
        batch_decode: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.weight_bytes = weight_bytes
        self.max_chunk = max(1, max_chunk)
        self.context_length: int | None = None  # tokens; set by load() from config.json (issue 16)
        self.chunk_timer = ChunkTimer(chunk_seconds)  # issue 16: chunks sized by time too
        self.max_concurrency = max(1, max_concurrency)
        self._own_usage = own_usage_fn or _default_own_usage
        self._reclaim = reclaim_fn or _default_reclaim
        self._clock = clock
        self._memory_wait = memory_wait
        self._eos = frozenset(tokenizer.eos_token_ids)
        self.cost = prefill_cost.prior_cost(model, self.max_chunk)
        self._queue: deque[Seq] = deque()
        self._prefill: deque[Seq] = deque()
        self._decoding: list[Seq] = []
        self._ids: set[str] = set()
        self._outbox: list[Event] = []
        self._prefill_turn = True
        self._decode_steps = 0
        self.tokens_total = 0
        self.prompt_tokens_processed = 0
        self._constraints: ConstraintFactory | None = None  # built on the first constrained request
        self.prompt_cache = pc.PromptCache(0, min_reuse=MIN_REUSE_TOKENS)  # H2: cap comes with limits
        layers = make_prompt_cache(model)
        self._cacheable = pc.supports(layers)
        self._layer_count = len(layers)
        # issue 11: unconstrained sequences decode as rows of one batch; models whose KV is
        # not plain attention (rotating, SSM) keep one forward pass per sequence.
        self.batch_decode = batch_decode and self._cacheable
        self._batch = DecodeBatch(greedy, max_rows=self.max_concurrency)
        self._joining: list[Seq] = []
        self._group: PrefillGroup | None = None  # issue 22: requests prefilled together

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "Engine":
        """Load a local model directory with mlx_lm (never a download)."""
        import mlx_lm

        directory = Path(path)
        if not (directory / "config.json").is_file():
            raise EngineError("load_failed", f"no model at {directory}: config.json not found")
        try:
            weight_bytes = estimate_weight_bytes(directory)
            # without return_config, load returns (model, tokenizer) (its type also allows a config)
            model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(directory)))
        except WeightsError as exc:
            raise EngineError("load_failed", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any loader failure is a load error
            raise EngineError("load_failed", f"cannot load {directory}: {exc}") from exc
        engine = cls(model, tokenizer, weight_bytes=weight_bytes, **kwargs)
        engine.context_length = context_length(directory)  # issue 16
        return engine

    # ------------------------------------------------------------------ prompts

    def encode_chat(self, messages: Iterable, tools: str | None = None) -> list[int]:
        """Chat messages through the model's chat template, ready for the reply (worker/prompts.py)."""
        return prompts.encode_chat(self.tokenizer, messages, tools)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt; BOS added unless the text already starts with it."""
        return prompts.encode_prompt(self.tokenizer, text)

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        request_id: str,
        prompt_tokens: list[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Iterable[str] = (),
        seed: int | None = None,
        constraint: ConstraintSpec | None = None,
    ) -> None:
        """Queue a request; it is admitted by a later `step()` (SPEC P3, P8)."""
        if not request_id:
            raise EngineError(INVALID_REQUEST, "request id must not be empty")
        if request_id in self._ids:
            raise EngineError(INVALID_REQUEST, f"request id {request_id!r} is already in use")
        if not prompt_tokens:
            raise EngineError(INVALID_REQUEST, "prompt is empty")
        if max_tokens < 1:
            raise EngineError(INVALID_REQUEST, f"max_tokens must be at least 1, got {max_tokens}")
        # issue 16: the prompt and the reply must fit the model's context window
        if self.context_length and len(prompt_tokens) + max_tokens > self.context_length:
            raise EngineError(CONTEXT_EXCEEDED, f"the prompt ({len(prompt_tokens)} tokens) plus max_tokens "
                                                f"({max_tokens}) exceeds the model's context of "
                                                f"{self.context_length} tokens; shorten the prompt or lower max_tokens")
        if not temperature >= 0:
            raise EngineError(INVALID_REQUEST, f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise EngineError(INVALID_REQUEST, f"top_p must be in (0, 1], got {top_p}")
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if vocab is not None and not all(0 <= t < vocab for t in prompt_tokens):
            raise EngineError(INVALID_REQUEST, f"prompt has token ids outside [0, {vocab})")
        stops = [s for s in stop if s]
        seq = Seq(request_id, list(prompt_tokens), max_tokens,
                   make_request_sampler(temperature, top_p, seed),
                   StopMatcher(stops) if stops else None,
                   self._constraint(constraint, max_tokens) if constraint is not None else None)
        self._ids.add(request_id)
        self._queue.append(seq)
        if self._cacheable:  # pinned while queued: a shrink must not take what it will reuse (H3)
            seq.hit = self.prompt_cache.lookup(seq.prompt, len(seq.prompt) - 1)

    def submit_generate(self, cmd: Generate) -> None:
        """Queue a wire `Generate`; bad input becomes its one terminal `Failed` (next step)."""
        try:
            if cmd.messages is not None and cmd.prompt is None:
                tokens = self.encode_chat(cmd.messages, cmd.tools)
            elif cmd.prompt is not None and cmd.messages is None and cmd.suffix is not None:  # issue 23
                tokens = prompts.encode_fim(self.tokenizer, cmd.prompt, cmd.suffix)
            elif cmd.prompt is not None and cmd.messages is None:
                tokens = self.encode_prompt(cmd.prompt)
            else:
                raise EngineError(INVALID_REQUEST, "give exactly one of messages or prompt")
            self.submit(cmd.request_id, tokens, cmd.max_tokens, cmd.temperature, cmd.top_p,
                        cmd.stop, cmd.seed, cmd.constraint)
        except EngineError as exc:
            self._outbox.append(Failed(request_id=cmd.request_id, code=exc.code, message=exc.message))
        except Exception as exc:  # noqa: BLE001 - raised from the worker's command loop it would kill
            # the worker and every stream on it; like a failed step, it fails this request alone
            log.exception("request %s could not be prepared", cmd.request_id)
            self._outbox.append(Failed(request_id=cmd.request_id, code=ENGINE_ERROR,
                                       message=f"the request could not be prepared: {exc!r}"))

    def _constraint(self, spec: ConstraintSpec, max_tokens: int) -> Constraint:
        """Issue 13: the request's grammar; a spec that cannot be enforced is invalid_request."""
        try:
            if self._constraints is None:
                vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
                self._constraints = ConstraintFactory(self.tokenizer, vocab or len(self.tokenizer.vocab))
            return self._constraints.build(spec, max_tokens)
        except ConstraintError as exc:
            raise EngineError(exc.code, exc.message) from None

    def abort(self, request_id: str, reason: str, code: str = "aborted") -> bool:
        """End one request with a terminal `Failed` (next step); False for an unknown id."""
        for line in (self._queue, self._prefill):
            for seq in line:
                if seq.id == request_id:
                    line.remove(seq)
                    self._outbox.append(self._fail(seq, code, reason))
                    return True
        group = self._group
        if group is not None:
            for i, seq in enumerate(group.rows):
                if seq is not None and seq.id == request_id:
                    group.rows[i] = None  # its row is still computed; nobody else's KV moves
                    if not group.live:
                        self._group = None
                    self._outbox.append(self._fail(seq, code, reason))
                    return True
        for seq in self._decoding:
            if seq.id == request_id:
                self._decoding.remove(seq)
                self._leave(seq)
                self._outbox.append(self._fail(seq, code, reason))
                return True
        return False

    def _leave(self, seq: Seq) -> None:
        """Between steps: an aborted sequence's row goes out of the batch (issue 11)."""
        if seq in self._joining:
            self._joining.remove(seq)
        else:
            self._batch.remove(seq)

    def abort_all(self, reason: str, code: str = "aborted") -> int:
        """End every request, queued ones included (P6.3, P6.5); how many were ended."""
        seqs = [*self._queue, *self._prefill, *self._grouped(), *self._decoding]
        self._group = None
        self._queue.clear()
        self._prefill.clear()
        self._decoding.clear()
        self._joining.clear()
        self._batch.clear()
        self._outbox.extend(self._fail(seq, code, reason) for seq in seqs)
        return len(seqs)

    def abort_queued(self, reason: str, code: str = "aborted") -> int:
        """End the requests not yet admitted (drain: running ones finish, the rest go)."""
        seqs = list(self._queue)
        self._queue.clear()
        self._outbox.extend(self._fail(seq, code, reason) for seq in seqs)
        return len(seqs)

    def memory_answer(self, request_id: str, evicted: bool) -> None:
        """The supervisor's reply to `NeedMemory`: retry the preflight once (G1)."""
        for seq in self._prefill:
            if seq.id == request_id and seq.state == "waiting":
                seq.move("retry")
                seq.retried = True
                if not evicted:
                    log.info("request %s: supervisor found nothing to evict", request_id)
                return

    # ------------------------------------------------------------------ status

    @property
    def running(self) -> int:
        return len(self._prefill) + len(self._grouped()) + len(self._decoding)

    def _grouped(self) -> list[Seq]:
        return self._group.live if self._group is not None else []

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        """False when `step()` would do nothing (the loop may then block on its sockets)."""
        if self._decoding or self._outbox or self._group is not None:
            return True
        if self._prefill:
            # Only the head of the prefill line can move; while it waits for the
            # supervisor's answer, admitting more would not move anything either.
            head = self._prefill[0]
            return head.state != "waiting" or self._clock() >= head.deadline
        return bool(self._queue)

    @property
    def cache_bytes(self) -> int:
        """H2: bytes the prompt cache holds (measured array sizes)."""
        return self.prompt_cache.nbytes

    @property
    def cache_releasable(self) -> int:
        """H3: the part no running or queued request relies on."""
        return self.prompt_cache.releasable

    def shrink_cache(self, target_bytes: int) -> int:
        """H3/P5: drop LRU unused entries toward `target_bytes`; bytes dropped (pool not yet returned)."""
        return self.prompt_cache.drop_lru(max(0, target_bytes))

    def next_deadline(self) -> float | None:
        """Earliest time a request waiting for memory retries on its own (loop timeouts)."""
        deadlines = [seq.deadline for seq in self._prefill if seq.state == "waiting"]
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------------ stepping

    def step(self, limits: Limits, usage_fn: UsageFn) -> list[Event]:
        """Admit what the limits allow, then run one prefill chunk or one decode token each."""
        events = self._outbox
        self._outbox = []
        if self._cacheable and (limits.cache_cap != self.prompt_cache.cap
                                or self.prompt_cache.nbytes > limits.cache_cap):
            self.prompt_cache.set_cap(limits.cache_cap)  # H2: over the cap, LRU goes
        self._admit(limits)
        if (self._prefill or self._group is not None) and (self._prefill_turn or not self._decoding):
            try:
                ran = self._prefill_step(limits, usage_fn, events)
            except Exception as exc:  # noqa: BLE001 - one request fails, the worker lives
                ran = True
                if self._group is not None:
                    failed, self._group = self._group.live, None
                else:
                    failed = [self._prefill.popleft()]
                self._engine_failure(failed, exc, events)
            if ran:
                self._prefill_turn = False
                return events
        if self._decoding:
            try:
                self._decode_step(events)
            except Exception as exc:  # noqa: BLE001
                alive = [seq for seq in self._decoding if seq.id in self._ids]
                self._decoding = []
                self._joining.clear()
                self._batch.clear()
                self._engine_failure(alive, exc, events)
            self._prefill_turn = True
        return events

    def _engine_failure(self, seqs: list[Seq], exc: Exception, events: list[Event]) -> None:
        """MLX raised (allocation failure, bad model code): fail these requests, keep serving.

        A worker that died here would take every other request and its loaded
        model with it; failing the requests involved and returning the pool
        leaves the supervisor to decide whether the worker should go.
        """
        log.error("generation failed for %d request(s): %r", len(seqs), exc)
        for seq in seqs:
            events.append(self._fail(seq, ENGINE_ERROR, f"generation failed: {exc}"))
        self._reclaim()

    def _admit(self, limits: Limits) -> None:
        """SPEC P8 cap; P3: while paused, take one only when nothing runs."""
        cap = min(self.max_concurrency, max(1, limits.max_concurrency))
        while self._queue and self.running < cap:
            if limits.admission_paused and self.running > 0:
                return
            seq = self._queue.popleft()
            seq.move("admit")
            self._prefill.append(seq)

    # ------------------------------------------------------------------ prefill

    def _prefill_step(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> bool:
        """Advance the prefill group, else the head of the prefill line; True when a chunk ran."""
        if self._group is None and self.batch_decode:
            self._group = self._form_group(limits, usage_fn)
            if self._group is not None:  # issue 23: a member's prompt is final (none reuses the cache)
                events.extend(self._prompted(seq) for seq in self._group.live)
        if self._group is not None:
            self._group_step(self._group, limits, usage_fn, events)
            return True
        seq = self._prefill[0]
        if seq.state == "waiting":
            if self._clock() < seq.deadline:
                return False
            seq.move("retry")
            seq.retried = True
        if seq.state == "preflight":
            if not self._preflight(seq, limits, usage_fn, events):
                return False
        remaining = len(seq.prompt) - 1 - seq.pos
        if remaining > 0 and not self._run_chunk(seq, remaining, limits, usage_fn, events):
            return True
        if seq.pos == len(seq.prompt) - 1:
            self._start_decoding(seq)
        return True

    # -- issue 22: prefilled together ---------------------------------------------------

    def _form_group(self, limits: Limits, usage_fn: UsageFn) -> PrefillGroup | None:
        """The requests at the front of the prefill line to prefill in one pass, or None.

        A member has not started, reuses no prompt-cache entry (a fork is its
        own KV), fits G1 alone, and does not make the group mostly padding; the
        group must fit G1 as the sum of its members' estimates, else it loses
        members from the back. The head of the line is always a member, so no
        request is passed over; with fewer than two members the head goes alone.
        """
        head = self._prefill[0]
        if head.state != "preflight" or head.hit is not None:
            return None
        if sum(1 for seq in self._prefill if seq.state == "preflight" and seq.hit is None) < 2:
            return None  # alone: no usage read here, the usual path reads it (G1 once)
        guarded = _guard_on(limits)
        members: list[Seq] = []
        for seq in self._prefill:
            if len(members) >= self.max_chunk:
                break
            if seq.state != "preflight" or seq.hit is not None:
                continue
            if members and not worth_padding([len(m.prompt) for m in members], len(seq.prompt)):
                continue
            if guarded and self._verdict(seq, limits, usage_fn).verdict != "fits":
                if seq is head:
                    return None  # the head's own G1 (NeedMemory, reject) goes the usual way
                continue
            members.append(seq)
        if guarded:
            while len(members) > 1 and not self._group_fits(members, limits, usage_fn()):
                members.pop()
        if len(members) < 2:
            return None
        for seq in members:
            self._prefill.remove(seq)
            seq.move("group")
        return PrefillGroup(members, [seq.prompt for seq in members], self._layer_count)

    def _group_fits(self, members: list[Seq], limits: Limits, usage: int) -> bool:
        """G1 for the group: usage plus the sum of each member's estimate, its KV padded to the
        longest; and G2's view of the group's first step (one column each) under the chunk target,
        since a group that cannot take its first step would only be split again."""
        limit, target = guard.prefill_limit(limits), guard.chunk_target(limits)
        padded = max(len(seq.prompt) for seq in members)
        peak = sum(guard.admission_peak(padded, self.cost, limits.min_chunk_tokens) for _ in members)
        first = len(members) * guard.padded_chunk_bytes(self.cost, 0, 1)
        return ((limit.bytes == 0 or usage + peak <= limit.bytes)
                and (target.bytes == 0 or usage + first <= target.bytes))

    def _group_step(self, group: PrefillGroup, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> None:
        """One chunk of columns for every row (G2 for the group's tokens, G3 after), or the first tokens."""
        rows = len(group)
        if group.remaining > 0:
            columns = min(group.remaining, max(1, self.max_chunk // rows))
            guarded = _guard_on(limits)
            if guarded:
                columns = self._group_columns(group, limits, usage_fn(), columns)
                if columns == 0:
                    self._split(group)  # a step for the group does not fit: each goes on alone (G2)
                    return
            columns = min(columns, max(1, self.chunk_timer.cap(columns * rows) // rows))
            done = group.pos
            real = group.real_tokens(columns)
            memory.reset_peak()
            before = mx.get_active_memory()
            started = time.monotonic()
            group.run_chunk(self.model, columns)
            self.chunk_timer.learn(time.monotonic() - started, columns * rows)
            # the rows are alike (same columns on the same positions): each grew the peak by its share
            self.cost = prefill_cost.learn(self.cost, (mx.get_peak_memory() - before) // rows, columns, done=done)
            self.prompt_tokens_processed += real
            mx.clear_cache()
            if guarded and not self._group_after_chunk(group, limits, usage_fn, events):
                return
            if group.remaining > 0:
                return
        self._start_group_decoding(group)

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

    def _group_after_chunk(self, group: PrefillGroup, limits: Limits, usage_fn: UsageFn,
                           events: list[Event]) -> bool:
        """G3 for the group: over the abort limit reclaim and re-check; still over fails its members."""
        level = guard.after_chunk(limits, usage_fn())
        if level == "over_abort":
            self._reclaim()
            usage = usage_fn()
            if guard.after_chunk(limits, usage) == "over_abort":
                self._group = None
                for seq in group.live:
                    events.append(self._memory_failure(seq, usage, limits.abort_limit,
                                                       guard.abort_binding(limits)))
                return False
        elif level == "over_soft":
            for seq in group.live:
                if not seq.warned_soft:
                    seq.warned_soft = True
                    log.info("request %s: prefill is above the soft limit", seq.id)
        return True

    def _split(self, group: PrefillGroup) -> None:
        """The group's requests back at the front of the line, each with its own KV so far."""
        self._group = None
        for seq, layers, held in reversed(group.split()):
            seq.cache = layers if layers is not None else make_prompt_cache(self.model)
            seq.pos = held
            seq.move("split")
            self._prefill.appendleft(seq)

    def _start_group_decoding(self, group: PrefillGroup) -> None:
        """Every row's last prompt token in one pass: the first tokens; the rows join the batch."""
        live = [(i, seq) for i, seq in enumerate(group.rows) if seq is not None]
        with mx.stream(generation_stream):
            logits = group.last_logits(self.model)
            for i, seq in live:
                row = logits[i:i + 1]
                seq.y = seq.sample(seq.constraint.mask(row) if seq.constraint is not None else row)
        mx.async_eval([seq.y for _, seq in live])
        self._group = None
        self.prompt_tokens_processed += len(live)
        for i, seq in live:
            seq.cache = group.row_kv(i)  # views: the batch copies the row in when it joins
            seq.detok = self.tokenizer.detokenizer
            seq.move("first_token")
            self._decoding.append(seq)
            self._joining.append(seq)

    def _preflight(self, seq: Seq, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> bool:
        """G1 (with H4 first); True when the prefill may start now."""
        if self._cacheable:  # look again: a request that finished meanwhile may cover more
            hit = self.prompt_cache.lookup(seq.prompt, len(seq.prompt) - 1)
            self.prompt_cache.release(seq.hit)
            seq.hit = hit
        if not _guard_on(limits):
            self._start_prefill(seq)
            events.append(self._prompted(seq))
            return True
        verdict = self._verdict(seq, limits, usage_fn)
        if verdict.verdict != "fits" and self.prompt_cache.drop_unused():
            self._reclaim()  # H4: our own unused entries go before anyone else's model
            verdict = self._verdict(seq, limits, usage_fn)
        if verdict.verdict == "fits":
            self._start_prefill(seq)
            events.append(self._prompted(seq))
            return True
        if verdict.verdict == "evict":
            seq.move("need_memory")
            seq.deadline = self._clock() + self._memory_wait
            events.append(NeedMemory(request_id=seq.id, need_bytes=verdict.need_bytes))
            return False
        self._prefill.popleft()
        events.append(self._memory_failure(seq, verdict.estimated_bytes, verdict.limit_bytes,
                                           verdict.binding))
        return False

    def _verdict(self, seq: Seq, limits: Limits, usage_fn: UsageFn) -> guard.Preflight:
        """G1 for the tokens still to run; a reused prefix costs only its copy (see prompt_cache)."""
        reused = seq.hit.tokens if seq.hit is not None else 0
        return guard.preflight(limits, usage_fn(), len(seq.prompt) - reused, self.cost,
                               own_usage=self._own_usage(), retried=seq.retried,
                               extra_bytes=int(reused * self.cost.kv_per_token), done=reused)

    def _start_prefill(self, seq: Seq) -> None:
        """The sequence's KV: a fork of its cache hit (H1), else empty."""
        if seq.hit is not None:
            seq.cache = pc.PromptCache.fork(seq.hit)
            seq.cached = seq.pos = seq.hit.tokens
            # The fork is a copy: from here on the entry is not in use (H3 may drop it).
            self.prompt_cache.release(seq.hit)
            seq.hit = None
        else:
            seq.cache = make_prompt_cache(self.model)
        seq.move("start")

    def _run_chunk(self, seq: Seq, remaining: int, limits: Limits, usage_fn: UsageFn,
                   events: list[Event]) -> bool:
        """G2 size, run, measure, G3 check; False when the request was failed."""
        guarded = _guard_on(limits)
        if guarded:
            plan = guard.next_chunk(limits, usage_fn(), remaining, self.cost, self.max_chunk,
                                    done=seq.pos)
            if plan.tokens == 0:
                self._prefill.popleft()
                events.append(self._memory_failure(seq, plan.estimated_bytes, plan.limit_bytes,
                                                   plan.binding))
                return False
            n = plan.tokens
        else:
            n = min(self.max_chunk, remaining)
        n = self.chunk_timer.cap(n)  # issue 16: a chunk also fits its time budget
        chunk = mx.array(seq.prompt[seq.pos:seq.pos + n])[None]
        memory.reset_peak()
        before = mx.get_active_memory()
        started = time.monotonic()
        with mx.stream(generation_stream):
            self.model(chunk, cache=seq.cache)
            mx.eval([c.state for c in seq.kv()])
        self.chunk_timer.learn(time.monotonic() - started, n)
        self.cost = prefill_cost.learn(self.cost, mx.get_peak_memory() - before, n, done=seq.pos)
        seq.pos += n
        self.prompt_tokens_processed += n
        mx.clear_cache()  # as mlx_lm does after every chunk: transient buffers go back
        if guarded:
            return self._after_chunk(seq, limits, usage_fn, events)
        return True

    def _after_chunk(self, seq: Seq, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> bool:
        """G3: over the abort limit reclaim and re-check; still over fails the request."""
        level = guard.after_chunk(limits, usage_fn())
        if level == "over_abort":
            self._reclaim()
            usage = usage_fn()
            if guard.after_chunk(limits, usage) == "over_abort":
                self._prefill.popleft()
                events.append(self._memory_failure(seq, usage, limits.abort_limit,
                                                   guard.abort_binding(limits)))
                return False
        elif level == "over_soft" and not seq.warned_soft:
            seq.warned_soft = True
            log.info("request %s: prefill is above the soft limit", seq.id)
        return True

    def _start_decoding(self, seq: Seq) -> None:
        """Feed the last prompt token; its sampled successor is the first output token."""
        last = mx.array(seq.prompt[-1:])[None]
        with mx.stream(generation_stream):
            logits = self.model(last, cache=seq.cache)[:, -1, :]
            if seq.constraint is not None:
                logits = seq.constraint.mask(logits)
            seq.y = seq.sample(logits)
        mx.async_eval(seq.y)
        self._prefill.popleft()
        self.prompt_tokens_processed += 1
        seq.detok = self.tokenizer.detokenizer
        seq.move("first_token")
        self._decoding.append(seq)
        if self.batch_decode:
            self._joining.append(seq)  # joins the batch at the next decode step (issue 11)

    # ------------------------------------------------------------------ decode

    def _decode_step(self, events: list[Event]) -> None:
        """One token for every decoding sequence, pipelined one step ahead like mlx_lm.

        Issue 11: every sequence advances as a row of one batch, in one forward
        pass (worker/batch.py); without batching (a model whose KV cannot be
        batched) each takes its own pass.

        Constrained sequences (issue 13) cannot sample ahead: the mask of their
        next token depends on the token still in flight. Their forward pass
        still runs ahead (it needs only the lazy token) while the grammar
        computes the mask; the free ones are sampled first and keep their
        look-ahead.
        """
        if self.batch_decode:
            survivors = self._batched_step(events)
        else:
            survivors = self._single_step(events)
        self._decoding = survivors
        self._decode_steps += 1
        if self._decode_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()

    def _batched_step(self, events: list[Event]) -> list[Seq]:
        """Joiners in, one batched pass queued, the previous tokens read at once, leavers out.

        A constrained row's next token waits for its mask, which needs the
        token just read: its sample is drawn after the read, from the same
        logits, and written into its place; the free rows keep their look-ahead.
        """
        batch = self._batch
        joining, self._joining = self._joining, []
        batch.join(joining, [seq.kv() for seq in joining], [seq.token() for seq in joining])
        for seq in joining:
            seq.cache = seq.y = None  # the batch holds its KV and token now
        logits = following = None
        if batch and any(seq.generated + 1 < seq.max_tokens for seq in batch.rows):
            with mx.stream(generation_stream):
                logits, following = batch.forward(self.model)
        if not batch:
            return []
        keep, survivors, late = [], [], []
        for i, (seq, token) in enumerate(zip(batch.rows, batch.tokens())):
            if self._emit(seq, token, events):
                self._ids.discard(seq.id)
                if self._cacheable and self.prompt_cache.cap > 0:
                    seq.cache = batch.extract(i)
                self._store(seq)
                seq.cache = None
                continue
            keep.append(i)
            survivors.append(seq)
            if seq.constraint is not None and logits is not None:
                with mx.stream(generation_stream):
                    late.append((i, seq.sample(seq.constraint.mask(logits[i:i + 1]))))
        if late:
            assert following is not None  # a late row had logits, so the pass ran
            with mx.stream(generation_stream):
                following = batch.place(following, late)
        batch.keep(keep, following)
        return survivors

    def _single_step(self, events: list[Event]) -> list[Seq]:
        """One pass per sequence (no batching): the path before issue 11."""
        seqs = [seq for seq in self._decoding if seq.constraint is None]
        bound = [seq for seq in self._decoding if seq.constraint is not None]
        following: list[mx.array | None] = []
        with mx.stream(generation_stream):
            for seq in seqs:
                if seq.generated + 1 < seq.max_tokens:
                    logits = self.model(seq.token()[None], cache=seq.cache)[:, -1, :]
                    following.append(seq.sample(logits))
                else:
                    following.append(None)
        mx.async_eval([y for y in following if y is not None])
        survivors = self._constrained_step(bound, events) if bound else []
        for seq, nxt in zip(seqs, following):
            if self._emit(seq, seq.token_id(), events):
                self._ids.discard(seq.id)
                self._store(seq)
                seq.cache = seq.y = None
            else:
                seq.y = nxt
                survivors.append(seq)
        return survivors

    def _constrained_step(self, seqs: list[Seq], events: list[Event]) -> list[Seq]:
        """Issue 13: queue the forward passes, then read each token and advance its grammar
        while they run, then queue the masked samples (only sampling waits for the mask)."""
        with mx.stream(generation_stream):
            ahead = [self.model(seq.token()[None], cache=seq.cache)[:, -1, :]
                     if seq.generated + 1 < seq.max_tokens else None for seq in seqs]
        mx.async_eval([logits for logits in ahead if logits is not None])
        survivors, following = [], []
        for seq, logits in zip(seqs, ahead):
            if self._emit(seq, seq.token_id(), events):
                self._ids.discard(seq.id)
                seq.cache = seq.y = None
                continue
            # a constrained sequence that did not end had room for one more token: its pass ran
            assert seq.constraint is not None and logits is not None
            with mx.stream(generation_stream):
                seq.y = seq.sample(seq.constraint.mask(logits))
            following.append(seq.y)
            survivors.append(seq)
        mx.async_eval(following)
        return survivors

    def _emit(self, seq: Seq, token: int, events: list[Event]) -> bool:
        """Turn one sampled token into events; True when the request finished."""
        seq.generated += 1
        seq.out.append(token)
        self.tokens_total += 1
        detok = seq.detok
        assert detok is not None  # set when the sequence started decoding
        if token in self._eos:
            detok.finalize()
            text = detok.last_segment
            if seq.stopper is not None:
                text, hit = seq.stopper.feed(text)
                text = text if hit else text + seq.stopper.flush()
            if text:
                events.append(TokenOut(request_id=seq.id, text=text))
            events.append(self._finished(seq, "stop"))
            return True
        detok.add_token(token)
        complete = False  # issue 13: the grammar of a constrained output is satisfied
        if seq.constraint is not None:
            if not seq.constraint.accept(token):
                events.append(self._fail(seq, seq.constraint.error_code, seq.constraint.error))
                return True
            complete = seq.constraint.done
        last = seq.generated >= seq.max_tokens or complete
        if last:
            detok.finalize()
        text = detok.last_segment
        if seq.stopper is not None:
            text, hit = seq.stopper.feed(text)
            if hit:
                events.append(TokenOut(request_id=seq.id, text=text, token_id=token))
                events.append(self._finished(seq, "stop"))
                return True
            if last:
                text += seq.stopper.flush()
        events.append(TokenOut(request_id=seq.id, text=text, token_id=token))
        if last:
            # a grammar the budget had to wrap up ends as "length", though its output is complete
            wrapped = complete and seq.constraint is not None and seq.constraint.wrapped
            events.append(self._finished(seq, "stop" if complete and not wrapped else "length"))
            return True
        return False

    # ------------------------------------------------------------------ endings

    def _prompted(self, seq: Seq) -> Prompted:
        """Issue 23: the prompt's length and cache reuse, final once its prefill starts."""
        return Prompted(request_id=seq.id, prompt_tokens=len(seq.prompt), cached_tokens=seq.cached)

    def _finished(self, seq: Seq, reason: str) -> Finished:
        seq.move("end")
        return Finished(request_id=seq.id, finish_reason=reason, prompt_tokens=len(seq.prompt),
                        completion_tokens=seq.generated, cached_tokens=seq.cached,
                        stop_sequence=seq.stopper.hit if seq.stopper is not None else "")

    def _store(self, seq: Seq) -> None:
        """H1: keep what the request computed (prompt and the tokens fed back) for the next one."""
        self.prompt_cache.release(seq.hit)
        seq.hit = None
        if not self._cacheable or self.prompt_cache.cap <= 0 or not seq.cache:
            return
        first = seq.cache[0]
        if not isinstance(first, KVCache):
            return
        self.prompt_cache.insert((seq.prompt + seq.out)[:first.offset], seq.cache)

    def _fail(self, seq: Seq, code: str, message: str, **extra) -> Failed:
        seq.move("end")
        self._ids.discard(seq.id)
        self.prompt_cache.release(seq.hit)
        seq.hit = None
        seq.cache = seq.y = None
        return Failed(request_id=seq.id, code=code, message=message, **extra)

    def _memory_failure(self, seq: Seq, estimated: int, limit: int, binding: str) -> Failed:
        """G1-G3 refusal; the KV memory the request held goes back to the OS at once."""
        event = self._fail(seq, guard.PREFILL_MEMORY_EXCEEDED,
                           guard.rejection_message(estimated, limit, binding),
                           estimated_bytes=estimated, limit_bytes=limit, binding=binding or "static")
        self._reclaim()
        return event


def _default_own_usage() -> int:
    return memory.usage()


def _default_reclaim() -> int:
    return memory.reclaim()
