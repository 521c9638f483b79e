"""Echo: a completion prompt scored token by token, for OpenAI completions' `echo` with `logprobs`.

lm-evaluation-harness scores a multiple-choice answer as the sum of its tokens'
log-probabilities given the question: it sends the question and the answer as one
token-id prompt with `echo: true, logprobs: 1, max_tokens: 1` and reads the
prompt tokens' logprobs back. A prefill computes the KV of a prompt but never
its logits (MLX is lazy, and nobody reads them), so scoring is a pass of its own:
the prompt runs chunk by chunk through a KV cache of its own, and each chunk's
logits, as float32 log-softmax, give the logprob of every next prompt token and
the most likely alternatives. The first token has no context: OpenAI's null.

Why beside the scheduler and not in it: a request's scoring runs before its
generation is queued, one chunk per engine step that it takes turns with
(worker/engine.py), under the same prefill guard (G2's chunk size, G3 after each
chunk: a scoring that does not fit is refused, it does not ask for room). When
the request then generates (max_tokens >= 1), the KV of all but its last prompt
token goes into the prompt cache (H1) where the prompt cache is on, so its
prefill reuses it instead of running the prompt a second time. A chunk's logits
are vocabulary-wide, so a chunk is also bounded by `LOGITS_BYTES`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import msgspec
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, make_prompt_cache

from shared.limits import Limits
from shared.protocol import MAX_FRAME_BYTES, Echoed, Failed, Finished, Generate, Prompted, TokenLogprobs, TopLogprob
from shared.sizes import MiB, format_size
from shared.vocab import FailureCode, LimitBinding
from worker import prefill_guard as guard
from worker.endings import Endings, Event
from worker.own_memory import UsageFn
from worker.prefill import Prefill
from worker.request import ENGINE_ERROR, INVALID_REQUEST, Seq
from worker.sampling import TokenTexts

log = logging.getLogger("memvisor.worker.engine")

LOGITS_BYTES = 256 * MiB  # a scoring chunk's float32 logits and their log-softmax stay under this
ECHO_MAX_BYTES = MAX_FRAME_BYTES - MiB  # an `Echoed` reply is one frame, with room for the frame's own bytes


class Scoring:
    """One echo request's prompt on its way through the scorer.

    `seq` is the generation that follows (None when max_tokens is 0: the prompt is all)."""

    __slots__ = ("cmd", "tokens", "seq", "cache", "pos", "chosen", "tops", "failure")

    def __init__(self, cmd: Generate, tokens: list[int], seq: Seq | None) -> None:
        self.cmd = cmd
        self.tokens = tokens
        self.seq = seq
        self.cache: list[Any] | None = None  # the prompt's KV so far
        self.pos = 0  # prompt tokens run through the model
        self.chosen: list[float] = []  # logprob of prompt token i + 1, for each i run
        self.tops: list[list[tuple[int, float]]] = []  # ... and the best alternatives there
        self.failure: Failed | None = None  # the guard refused it

    @property
    def request_id(self) -> str:
        return self.cmd.request_id

    @property
    def scored(self) -> bool:
        return self.pos >= len(self.tokens) - 1


class PromptScorer:
    """Echo requests waiting to be scored, one chunk of the oldest per `step`."""

    def __init__(self, model, tokenizer, prefill: Prefill, texts: TokenTexts, reclaim: Callable[[], int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prefill = prefill  # its chunk timer, G2's cost estimate and the guarded pool
        self.texts = texts
        self.jobs: deque[Scoring] = deque()
        self.reclaim = reclaim
        args = getattr(model, "args", None)
        vocab = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self._rows = max(1, LOGITS_BYTES // (8 * vocab))  # the logits' rows a chunk may hold

    def remove(self, request_id: str) -> Scoring | None:
        for job in self.jobs:
            if job.request_id == request_id:
                self.jobs.remove(job)
                return job
        return None

    def step(self, limits: Limits, usage_fn: UsageFn) -> Scoring | None:
        """One chunk of the oldest job; the job once it is scored or refused (then out of the line)."""
        job = self.jobs[0]
        if not job.scored and job.failure is None:
            self._chunk(job, limits, usage_fn)
        if job.scored or job.failure is not None:
            self.jobs.popleft()
            return job
        return None

    def _chunk(self, job: Scoring, limits: Limits, usage_fn: UsageFn) -> None:
        pool = self.prefill.pool(limits, usage_fn)
        remaining = len(job.tokens) - 1 - job.pos
        tokens = self.prefill.chunk_timer.cap(min(remaining, self.prefill.max_chunk, self._rows))
        guarded = guard.guard_on(pool.limits)
        if guarded:  # G2: what fits under the chunk target
            plan = guard.next_chunk(pool.limits, pool.usage(), remaining, self.prefill.cost, tokens, done=job.pos)
            if plan.tokens == 0:
                job.failure = self._refusal(job, plan.estimated_bytes, plan.limit_bytes, plan.binding)
                return
            tokens = plan.tokens
        self._run(job, tokens)
        if guarded and guard.after_chunk(pool.limits, pool.usage()) == "over_abort":  # G3
            self.reclaim()
            usage = pool.usage()
            if guard.after_chunk(pool.limits, usage) == "over_abort":
                job.failure = self._refusal(job, usage, pool.limits.abort_limit, guard.abort_binding(pool.limits))

    def _run(self, job: Scoring, n: int) -> None:
        """Prompt tokens pos..pos+n through the model; the logprobs of tokens pos+1..pos+n+1."""
        if job.cache is None:
            job.cache = make_prompt_cache(self.model)
        top = job.cmd.top_logprobs
        chunk = mx.array(job.tokens[job.pos:job.pos + n])[None]
        following = mx.array(job.tokens[job.pos + 1:job.pos + n + 1])[:, None]
        with mx.stream(generation_stream):
            logits = self.model(chunk, cache=job.cache)[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            chosen = mx.take_along_axis(logprobs, following, axis=-1)[:, 0]
            ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top] if top else None
            values = mx.take_along_axis(logprobs, ids, axis=-1) if ids is not None else None
        mx.eval([a for a in (chosen, ids, values) if a is not None], [c.state for c in job.cache])
        job.chosen += cast(list[float], chosen.tolist())
        if ids is not None and values is not None:
            job.tops += [list(zip(i, v)) for i, v in zip(cast(list[list[int]], ids.tolist()),
                                                         cast(list[list[float]], values.tolist()))]
        job.pos += n
        self.prefill.tokens += n
        mx.clear_cache()

    def _refusal(self, job: Scoring, estimated: int, limit: int, binding: LimitBinding) -> Failed:
        return Failed(request_id=job.request_id, code=guard.PREFILL_MEMORY_EXCEEDED,
                      message=guard.rejection_message(estimated, limit, binding), estimated_bytes=estimated,
                      limit_bytes=limit, binding=binding or "static")

    # -- what the job says -------------------------------------------------------------------

    def echoed(self, job: Scoring) -> Echoed:
        """The prompt as read: its text and, when asked, each token's logprob (the first has none)."""
        text = self.tokenizer.decode(job.tokens)
        if not job.cmd.logprobs:
            return Echoed(request_id=job.request_id, text=text)
        texts = self.texts
        items = []
        for i, token in enumerate(job.tokens[1:]):
            top = sorted(job.tops[i], key=lambda pair: (-pair[1], pair[0])) if job.tops else []
            items.append(TokenLogprobs(token=texts(token), logprob=job.chosen[i],
                                       top=[TopLogprob(token=texts(t), logprob=lp) for t, lp in top]))
        return Echoed(request_id=job.request_id, text=text, tokens=[texts(t) for t in job.tokens], logprobs=items)


def scored_kv(job: Scoring) -> tuple[Sequence[int], list[Any]] | None:
    """The KV the scoring left (of every prompt token but the last), for the prompt cache: exactly
    what the generation's prefill would compute before its first token."""
    if job.cache is None or not job.cache or not isinstance(job.cache[0], KVCache):
        return None
    return job.tokens[:job.pos], job.cache


class Echoes:
    """The echo requests of one engine, from submission to their generation's queueing.

    Every request ends once: a refused or aborted echo ends here (its id is free
    again), an echo with max_tokens 0 finishes here, any other goes on to the
    scheduler (`queue`) as a request of its own kind."""

    def __init__(self, scorer: PromptScorer, endings: Endings, queue: Callable[[Seq], None]) -> None:
        self.scorer = scorer
        self.jobs = scorer.jobs
        self.endings = endings
        self._queue = queue

    def add(self, job: Scoring) -> list[Event]:
        """A checked echo in: scored first when it asks for logprobs; the events it has now."""
        self.endings.ids.add(job.request_id)
        if job.cmd.logprobs and len(job.tokens) > 1:
            self.jobs.append(job)
            return []
        return self._scored(job)  # the text alone, or one token (no context: nothing to score)

    def step(self, limits: Limits, usage_fn: UsageFn, events: list[Event]) -> None:
        """One chunk of the oldest echo's scoring; MLX raising fails that request alone."""
        try:
            job = self.scorer.step(limits, usage_fn)
        except Exception as exc:  # noqa: BLE001 - as a failed step: this request fails, the worker serves on
            log.error("scoring an echoed prompt failed: %r", exc)
            job = self.jobs.popleft()
            job.failure = Failed(request_id=job.request_id, code=ENGINE_ERROR, message=f"scoring failed: {exc}")
            self.scorer.reclaim()
        if job is not None:
            events.extend(self._scored(job))

    def abort(self, request_id: str, code: FailureCode, reason: str) -> Failed | None:
        job = self.scorer.remove(request_id)
        return None if job is None else self._end(job, Failed(request_id=request_id, code=code, message=reason))

    def abort_all(self, code: FailureCode, reason: str) -> list[Failed]:
        jobs = list(self.jobs)
        self.jobs.clear()
        return [self._end(job, Failed(request_id=job.request_id, code=code, message=reason)) for job in jobs]

    def _scored(self, job: Scoring) -> list[Event]:
        """A scored (or refused) echo's events; its generation, if any, goes to the scheduler."""
        if job.failure is not None:
            return [self._end(job, job.failure)]
        echoed = self.scorer.echoed(job)
        size = len(msgspec.msgpack.encode(echoed))
        if size > ECHO_MAX_BYTES:
            return [self._end(job, Failed(
                request_id=job.request_id, code=INVALID_REQUEST,
                message=f"echo: the logprobs of {len(job.tokens)} prompt tokens with {job.cmd.top_logprobs} "
                        f"alternatives each take {format_size(size)}, more than one reply may; ask for fewer "
                        "alternatives or send shorter prompts"))]
        if job.seq is None:  # max_tokens 0: the prompt is the whole reply
            self.endings.ids.discard(job.request_id)
            n = len(job.tokens)
            return [echoed, Prompted(request_id=job.request_id, prompt_tokens=n),
                    Finished(request_id=job.request_id, finish_reason="length", prompt_tokens=n, completion_tokens=0)]
        kv = scored_kv(job)
        if kv is not None and self.endings.keeps_kv:  # its prefill reuses what the scoring computed (H1)
            self.endings.prompt_cache.insert(*kv, partition=job.cmd.partition)
        self._queue(job.seq)
        return [echoed]

    def _end(self, job: Scoring, failed: Failed) -> Failed:
        if job.seq is not None:
            job.seq.move("end")
        self.endings.ids.discard(job.request_id)
        return failed
