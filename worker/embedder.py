"""An embedding model in a worker: what the loop drives in place of the chat engine.

Why the same shape as worker/engine.py's `Engine`: the worker's loop, its
commands (abort, drain, reclaim, the memory answer), its samples and its
heartbeat treat an embedding model exactly as a chat model, so the guard's
rules (memory, admission, eviction, pinning, TTL) apply unchanged. The loop
calls `step()`; a step embeds one batch of rows, taken from the requests
admitted (P8's cap; P3: while admission is paused, a new one only when none
runs), first in first out, each request's rows longest first so a batch pads
little. Rows of several requests share a batch: eight clients embedding one
sentence each cost one forward, not eight.

Memory (SPEC G1-G3 in worker/embed_guard.py's terms): the next row must fit
(else the supervisor is asked to evict once, then the request is refused with
`prefill_memory_exceeded`), a step takes as many rows as fit under the chunk
target and its time bound, and a step that leaves the group over the abort
limit fails its requests after a reclaim. There is no prompt cache: the
vectors are the reply, nothing is kept between requests.

The tokenizer is the folder's tokenizer.json (Rust `tokenizers`, with its
own padding and truncation switched off: the batch is padded here, and an
input over the model's limit is refused or, where the request says
`truncate`, cut by a second tokenizer that keeps the closing special token).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Callable, Literal, Union

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from shared.embedding import WRONG_MODEL_KIND, EmbeddingSpec, read_embedding_spec
from shared.limits import Limits
from shared.protocol import Embed, Embedded, Failed, Generate, NeedMemory
from shared.vocab import FailureCode, LimitBinding
from shared.weights import WeightsError, estimate_weight_bytes
from worker import embed_guard as eg
from worker import own_memory
from worker import prefill_guard as guard
from worker.bert import Bert, BertError, normalize
from worker.own_memory import UsageFn
from worker.prefill import CHUNK_SECONDS, MEMORY_WAIT_SECONDS, ChunkTimer
from worker.request import CONTEXT_EXCEEDED, ENGINE_ERROR, INVALID_REQUEST, EngineError

log = logging.getLogger("memvisor.worker.embedder")

EmbedderEvent = Union[Embedded, Failed, NeedMemory]
MAX_STEP_TOKENS = 16384  # padded tokens in one step at most, whatever the timer learned
JobState = Literal["queued", "running", "waiting"]


class EmbedJob:
    """One `Embed` request: its inputs' tokens, the rows done, the vectors so far."""

    __slots__ = ("id", "tokens", "order", "done", "out", "dimensions", "state", "deadline", "retried")

    def __init__(self, request_id: str, tokens: list[list[int]], dims: int, dimensions: int | None) -> None:
        self.id = request_id
        self.tokens = tokens
        self.order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))  # longest first: less padding
        self.done = 0  # rows of `order` embedded
        self.out = np.zeros((len(tokens), dims), dtype=np.float32)
        self.dimensions = dimensions
        self.state: JobState = "queued"
        self.deadline = 0.0  # while waiting for the supervisor's memory answer
        self.retried = False

    @property
    def left(self) -> list[int]:
        return self.order[self.done:]


class Embedder:
    """Sentence embeddings for one loaded model (see module doc)."""

    def drop_draft(self) -> bool:
        """An embedding model guesses nothing (worker/draft.py is the chat engine's): nothing to drop."""
        return False

    def __init__(self, model: Bert, tokenizer: Tokenizer, spec: EmbeddingSpec, *, weight_bytes: int = 0,
                 max_concurrency: int = 64, chunk_seconds: float = CHUNK_SECONDS,
                 own_usage_fn: UsageFn | None = None, reclaim_fn: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic, memory_wait: float = MEMORY_WAIT_SECONDS) -> None:
        self.model = model
        self.spec = spec
        self.weight_bytes = weight_bytes
        self.max_concurrency = max(1, max_concurrency)
        self.context_length = spec.max_tokens
        self._tokenizer = _plain(tokenizer)
        self._cutter = _plain(Tokenizer.from_str(tokenizer.to_str()))
        self._cutter.enable_truncation(max_length=spec.max_tokens)
        self._pad = 0  # what fills a row past its end: masked out, so any id of the vocabulary does
        self._own_usage = own_usage_fn or own_memory.usage
        self._reclaim = reclaim_fn or own_memory.reclaim
        self._clock = clock
        self._memory_wait = memory_wait
        self.timer = ChunkTimer(chunk_seconds)
        a = model.args
        self.cost = eg.prior_cost(a.hidden_size, a.intermediate_size, a.num_attention_heads,
                                  model.dtype.size)
        self._queue: deque[EmbedJob] = deque()
        self._running: list[EmbedJob] = []
        self._ids: set[str] = set()
        self._outbox: list[EmbedderEvent] = []
        self.tokens_total = 0  # input tokens embedded: the heartbeat's and samples' progress

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> Embedder:
        """The folder's encoder, tokenizer and sentence-transformers settings (never a download)."""
        folder = Path(path)
        spec = read_embedding_spec(folder)
        if spec is None:
            raise EngineError("load_failed", f"{folder} is not a sentence-embedding model (no modules.json "
                                             "with a Pooling module)")
        try:
            weight_bytes = estimate_weight_bytes(folder)
            model = Bert.load(folder)
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except (WeightsError, BertError) as exc:
            raise EngineError("load_failed", f"cannot load {folder}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a missing or broken tokenizer.json, a torn weights file
            raise EngineError("load_failed", f"cannot load {folder}: {exc}") from exc
        mx.eval(list(model.w.values()))  # the weights are resident once Loaded says so
        return cls(model, tokenizer, spec, weight_bytes=weight_bytes, **kwargs)

    # ------------------------------------------------------------------ requests

    def submit_generate(self, cmd: Generate) -> None:
        """A chat or completion request: this model only embeds."""
        self._outbox.append(Failed(request_id=cmd.request_id, code=WRONG_MODEL_KIND,
                                   message="this model is an embedding model: it serves /v1/embeddings and "
                                           "/api/embed, not chat, completions or generation"))

    def submit_embed(self, cmd: Embed) -> None:
        """Queue an `Embed`; bad input becomes its one terminal `Failed` (next step)."""
        try:
            tokens = self._tokens(cmd)
            dimensions = cmd.dimensions if cmd.dimensions not in (None, self.spec.dims) else None
            if dimensions is not None and not self.spec.allows_dimensions(dimensions):
                raise EngineError(INVALID_REQUEST, f"dimensions {dimensions}: this model's vectors have "
                                                   f"{self.spec.dims} and it was not trained to be cut shorter")
            cap = self.spec.input_cap(dimensions)
            if len(tokens) > cap:
                raise EngineError(INVALID_REQUEST, f"{len(tokens)} inputs: at most {cap} per request")
            if cmd.request_id in self._ids or not cmd.request_id:
                raise EngineError(INVALID_REQUEST, f"request id {cmd.request_id!r} is empty or already in use")
        except EngineError as exc:
            self._outbox.append(Failed(request_id=cmd.request_id, code=exc.code, message=exc.message))
            return
        except Exception as exc:  # noqa: BLE001 - it would kill the worker's loop and every request on it
            log.exception("request %s could not be prepared", cmd.request_id)
            self._outbox.append(Failed(request_id=cmd.request_id, code=ENGINE_ERROR,
                                       message=f"the request could not be prepared: {exc!r}"))
            return
        self._ids.add(cmd.request_id)
        self._queue.append(EmbedJob(cmd.request_id, tokens, self.spec.dims, dimensions))

    def _tokens(self, cmd: Embed) -> list[list[int]]:
        if (cmd.texts is None) == (cmd.token_ids is None):
            raise EngineError(INVALID_REQUEST, "give exactly one of texts and token_ids")
        if cmd.token_ids is not None:
            tokens = [list(ids) for ids in cmd.token_ids]
            vocab = self.model.args.vocab_size
            if any(not ids for ids in tokens):
                raise EngineError(INVALID_REQUEST, "an input of token ids is empty")
            if not all(0 <= t < vocab for ids in tokens for t in ids):
                raise EngineError(INVALID_REQUEST, f"token ids must be in [0, {vocab})")
        else:
            tokens = [e.ids for e in self._tokenizer.encode_batch(cmd.texts or [])]
        if not tokens:
            raise EngineError(INVALID_REQUEST, "no inputs to embed")
        limit = self.spec.max_tokens
        over = [i for i, ids in enumerate(tokens) if len(ids) > limit]
        if over and cmd.truncate and cmd.texts is not None:
            cut = self._cutter.encode_batch([cmd.texts[i] for i in over])
            for i, enc in zip(over, cut):
                tokens[i] = enc.ids
        elif over and cmd.truncate:
            for i in over:
                tokens[i] = tokens[i][:limit]
        elif over:
            i = over[0]
            raise EngineError(CONTEXT_EXCEEDED, f"input {i} is {len(tokens[i])} tokens, over this model's limit "
                                                f"of {limit}; shorten it (or ask for truncation)")
        return tokens

    def abort(self, request_id: str, reason: str, code: FailureCode = "aborted") -> bool:
        for line in (self._queue, self._running):
            for job in line:
                if job.id == request_id:
                    line.remove(job)
                    self._outbox.append(self._fail(job, code, reason))
                    return True
        return False

    def abort_all(self, reason: str, code: FailureCode = "aborted") -> int:
        jobs = [*self._queue, *self._running]
        self._queue.clear()
        self._running.clear()
        self._outbox.extend(self._fail(job, code, reason) for job in jobs)
        return len(jobs)

    def abort_queued(self, reason: str, code: FailureCode = "aborted") -> int:
        jobs = list(self._queue)
        self._queue.clear()
        self._outbox.extend(self._fail(job, code, reason) for job in jobs)
        return len(jobs)

    def memory_answer(self, request_id: str, evicted: bool) -> None:
        """The supervisor's reply to `NeedMemory`: check G1 again, once."""
        for job in self._running:
            if job.id == request_id and job.state == "waiting":
                job.state, job.retried = "running", True
                if not evicted:
                    log.info("request %s: supervisor found nothing to evict", request_id)

    # ------------------------------------------------------------------ status (the loop's view)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        if self._outbox:
            return True
        now = self._clock()
        if any(job.state == "running" or now >= job.deadline for job in self._running):
            return True
        return bool(self._queue) and len(self._running) < self.max_concurrency

    cache_bytes = 0  # H2: no prompt cache: nothing is kept between requests
    cache_releasable = 0

    def shrink_cache(self, target_bytes: int) -> int:
        return 0

    def next_deadline(self) -> float | None:
        deadlines = [job.deadline for job in self._running if job.state == "waiting"]
        return min(deadlines) if deadlines else None

    # ------------------------------------------------------------------ stepping

    def step(self, limits: Limits, usage_fn: UsageFn) -> list[EmbedderEvent]:
        """Admit what the limits allow, then embed one batch of rows."""
        events, self._outbox = self._outbox, []
        self._admit(limits)
        job = next((j for j in self._running if j.state == "running" or self._clock() >= j.deadline), None)
        if job is None:
            return events
        job.state = "running"
        try:
            self._step(job, limits, usage_fn, events)
        except Exception as exc:  # noqa: BLE001 - MLX raised: these requests fail, the worker lives
            log.error("embedding failed: %r", exc)
            for failed in list(self._running):
                self._running.remove(failed)
                events.append(self._fail(failed, ENGINE_ERROR, f"embedding failed: {exc}"))
            self._reclaim()
        return events

    def _admit(self, limits: Limits) -> None:
        """SPEC P8's cap; P3: while paused, a new request only when none runs."""
        cap = min(self.max_concurrency, max(1, limits.max_concurrency))
        while self._queue and len(self._running) < cap:
            if limits.admission_paused and self._running:
                return
            job = self._queue.popleft()
            job.state = "running"
            self._running.append(job)

    def _step(self, job: EmbedJob, limits: Limits, usage_fn: UsageFn, events: list[EmbedderEvent]) -> None:
        guarded = guard.guard_on(limits)
        usage = usage_fn() if guarded else 0
        head = len(job.tokens[job.left[0]])
        verdict = (eg.first_row(limits, usage, self._own_usage(), self.cost, head, retried=job.retried)
                   if guarded else eg.RowVerdict("fits"))
        if verdict.verdict == "evict":
            job.state, job.deadline = "waiting", self._clock() + self._memory_wait
            events.append(NeedMemory(request_id=job.id, need_bytes=verdict.need_bytes))
            return
        if verdict.verdict == "reject":
            self._running.remove(job)
            events.append(self._memory_failure(job, verdict.estimated_bytes, verdict.limit_bytes, verdict.binding))
            return
        rows = self._rows(job, limits, usage)
        self._run(rows)
        if guarded and not self._after_step(rows, limits, usage_fn, events):
            return
        for done in {id(j): j for j, _ in rows}.values():
            if done.done == len(done.order):
                self._running.remove(done)
                events.append(self._finish(done))

    def _rows(self, job: EmbedJob, limits: Limits, usage: int) -> list[tuple[EmbedJob, int]]:
        """The next batch: `job`'s rows first, then those of the requests after it (G2)."""
        waiting = [(j, i) for j in [job, *(o for o in self._running if o is not job and o.state == "running")]
                   for i in j.left]
        lengths = [len(j.tokens[i]) for j, i in waiting]
        budget = min(MAX_STEP_TOKENS, max(lengths[0], self.timer.cap(MAX_STEP_TOKENS)))
        return waiting[:eg.rows_for_step(limits, usage, self.cost, lengths, budget)]

    def _run(self, rows: list[tuple[EmbedJob, int]]) -> None:
        """One forward over the rows, right-padded; each vector lands in its request."""
        seqs = [j.tokens[i] for j, i in rows]
        length = max(len(s) for s in seqs)
        ids = np.full((len(seqs), length), self._pad, dtype=np.int32)
        mask = np.zeros((len(seqs), length), dtype=bool)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = s
            mask[r, :len(s)] = True
        own_memory.reset_peak()
        before = mx.get_active_memory()
        started = time.monotonic()
        vectors = self.model.embed(mx.array(ids), mx.array(mask), self.spec)
        mx.eval(vectors)
        self.timer.learn(time.monotonic() - started, ids.size)
        self.cost = eg.learn(self.cost, mx.get_peak_memory() - before, len(seqs), length)
        out = np.asarray(vectors)
        for r, (job, i) in enumerate(rows):
            job.out[i] = out[r]
            job.done += 1
        self.tokens_total += int(mask.sum())
        del vectors
        mx.clear_cache()

    def _after_step(self, rows: list[tuple[EmbedJob, int]], limits: Limits, usage_fn: UsageFn,
                    events: list[EmbedderEvent]) -> bool:
        """G3: over the abort limit, reclaim and look again; still over fails what ran."""
        if guard.after_chunk(limits, usage_fn()) != "over_abort":
            return True
        self._reclaim()
        usage = usage_fn()
        if guard.after_chunk(limits, usage) != "over_abort":
            return True
        for job in {id(j): j for j, _ in rows}.values():
            self._running.remove(job)
            events.append(self._memory_failure(job, usage, limits.abort_limit, guard.abort_binding(limits)))
        return False

    def _finish(self, job: EmbedJob) -> Embedded:
        self._ids.discard(job.id)
        vectors = job.out
        if job.dimensions is not None:  # Matryoshka: the first `dimensions` values, at unit length again
            cut = mx.array(vectors[:, :job.dimensions])
            vectors = np.array(normalize(cut) if self.spec.normalize else cut)
        return Embedded(request_id=job.id, dimensions=vectors.shape[1],
                        vectors=np.ascontiguousarray(vectors, dtype="<f4").tobytes(),
                        token_counts=[len(t) for t in job.tokens])

    def _fail(self, job: EmbedJob, code: FailureCode, message: str, **extra) -> Failed:
        self._ids.discard(job.id)
        return Failed(request_id=job.id, code=code, message=message, **extra)

    def _memory_failure(self, job: EmbedJob, estimated: int, limit: int, binding: LimitBinding) -> Failed:
        event = self._fail(job, guard.PREFILL_MEMORY_EXCEEDED,
                           guard.rejection_message(estimated, limit, binding, what="input batch",
                                                   during="embedding"),
                           estimated_bytes=estimated, limit_bytes=limit, binding=binding or "static")
        self._reclaim()
        return event


def _plain(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer with the folder's own padding and truncation off (all-MiniLM's pads
    and cuts every input to 128 tokens)."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer
