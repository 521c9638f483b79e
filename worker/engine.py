"""One model, many requests, advanced one step at a time: the engine's front.

The worker's main loop owns the sockets and the ledger; it hands requests to
`submit_generate`, commands to `abort` / `memory_answer` / `shrink_cache`,
calls `step()` in a loop and forwards the events it returns. Nothing in the
engine talks to a socket or decides policy: limits arrive as a
`shared.limits.Limits` the loop reads from the ledger, and the group's memory
usage through a `usage_fn` callback.

Follow one request through the rooms:

    Engine.submit                  checks it, makes its `Seq` (worker/request.py: the state table)
    Scheduler (scheduler.py)       queue -> admission -> the prefill line, alone or in a group;
                                   who runs this step: a prefill turn (its token budget shared
                                   by every prefilling request) or a decode token
    Prefill (prefill.py)           G1 before the first chunk, G2/G3 around each, the first token
    DecodeStep (decode.py)         one token per step in the decode batch (batch.py), emitted
    Endings (endings.py)           its one terminal event, its KV kept for the next (H1)

Every submitted request ends with exactly one terminal event (`Finished` or
`Failed`), and every event leaves through `step()`: terminal events of aborts
and refused submissions wait in an outbox that the next `step()` returns
first, so the loop has one place to forward from.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from shared.limits import Limits
from shared.modelinfo import context_length
from shared.protocol import SHARED_PARTITION, ConstraintSpec, Failed, Generate
from shared.vocab import FailureCode, PrefillOrder
from worker import own_memory, prompts
from worker import prompt_cache as pc
from worker.constrain import Constraint, ConstraintError, ConstraintFactory
from worker.decode import DecodeStep
from worker.disk_cache import DiskTier
from worker.draft import DraftModel
from worker.echo import Echoes, PromptScorer, Scoring
from worker.endings import Endings, Event
from worker.folder_load import load_folders
from worker.loader import LoadMeter
from worker.own_memory import UsageFn
from worker.prefill import (
    CHUNK_SECONDS,
    DEFAULT_MAX_CHUNK,
    MEMORY_WAIT_SECONDS,
    ChunkTimer,
    DeviceUsage,
    Prefill,
)
from worker.prefill_guard import PrefillCost
from worker.request import ENGINE_ERROR, INVALID_REQUEST, EngineError, Seq
from worker.request_checks import check_prompt, check_sampling, model_vocab, prompt_of
from worker.sampling import Settings, greedy, make_request_sampler
from worker.scheduler import Scheduler
from worker.speculate import Speculation
from worker.stops import StopMatcher

__all__ = ["Engine", "EngineError", "Event"]

log = logging.getLogger("memvisor.worker.engine")

MIN_REUSE_TOKENS = 16  # a shorter shared prefix (BOS, a template's first tokens) is no cache hit
WARM_UP_ROWS = 4       # the group the warm-up prefills together (any group takes the masked kind)


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
        device: DeviceUsage | None = None,
        prefill_order: PrefillOrder = "shortest",
        speculative: bool = True,
        draft: DraftModel | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.weight_bytes = weight_bytes
        self.context_length: int | None = None  # tokens; set by load() from config.json
        self.prompt_cache = pc.PromptCache(0, min_reuse=MIN_REUSE_TOKENS)  # H2: cap comes with limits
        layers = make_prompt_cache(model)
        cacheable = pc.supports(layers)
        reclaim = reclaim_fn or _default_reclaim
        self.endings = Endings(self.prompt_cache, cacheable=cacheable, reclaim=reclaim)
        self.prefill = Prefill(model, tokenizer, self.endings, layers=len(layers), max_chunk=max_chunk,
                               chunk_seconds=chunk_seconds, own_usage=own_usage_fn or _default_own_usage,
                               reclaim=reclaim, clock=clock, memory_wait=memory_wait, device=device)
        # unconstrained requests decode as rows of one batch; models whose KV is
        # not plain attention (rotating, SSM) keep one forward pass per request.
        self.decode = DecodeStep(model, tokenizer, self.endings, batched=batch_decode and cacheable,
                                 max_rows=max(1, max_concurrency))
        self.scheduler = Scheduler(self.prefill, self.decode, self.endings,
                                   max_concurrency=max_concurrency, clock=clock, order=prefill_order)
        # greedy requests decoding alone check guesses of their next tokens (worker/speculate.py)
        self.speculative = speculative and self.decode.batched
        self.decode.draft = draft if self.speculative else None
        self.echoes = Echoes(PromptScorer(model, tokenizer, self.prefill, self.decode.texts, reclaim),
                             self.endings, self._queue)
        self._score_turn = True  # an echo's scoring chunk and the scheduler's step take turns
        self._outbox: list[Event] = []
        self._constraints: ConstraintFactory | None = None  # built on the first constrained request
        self.disk: DiskTier | None = None  # the prompt cache's disk tier (H5 as proposed), when on
        self._spill_seconds = 0.0

    @classmethod
    def load(cls, path: str | Path, *, meter: LoadMeter | None = None, draft_path: str = "", **kwargs) -> "Engine":
        """Load a local model directory as mlx_lm.load does (never a download), each
        phase timed on `meter` (SPEC W3, worker/loader.py), and its draft model
        (worker/draft.py) from `draft_path` when one is named."""
        directory = Path(path)
        weight_bytes, model, tokenizer, draft = load_folders(directory, meter, draft_path)
        with meter.phase("build") if meter is not None else contextlib.nullcontext():  # the engine is built too
            engine = cls(model, tokenizer, weight_bytes=weight_bytes, draft=draft, **kwargs)
            engine.context_length = context_length(directory)  # a prompt over it is refused, not run
        return engine

    # -- what the rooms know, read from the front -------------------------------------------

    @property
    def max_chunk(self) -> int:
        return self.prefill.max_chunk

    @property
    def max_concurrency(self) -> int:
        return self.scheduler.max_concurrency

    @property
    def cost(self) -> PrefillCost:
        """G2's running estimate of what a prefill chunk costs."""
        return self.prefill.cost

    @property
    def chunk_timer(self) -> ChunkTimer:
        return self.prefill.chunk_timer

    @property
    def batch_decode(self) -> bool:
        return self.decode.batched

    @property
    def tokens_total(self) -> int:
        return self.decode.tokens_total

    @property
    def prompt_tokens_processed(self) -> int:
        return self.prefill.tokens

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def queued(self) -> int:
        return len(self.scheduler.queue)

    @property
    def has_work(self) -> bool:
        """False when `step()` would do nothing (the loop may then block on its sockets)."""
        return bool(self._outbox) or bool(self.echoes.jobs) or self.scheduler.has_work

    def next_deadline(self) -> float | None:
        """Earliest time a request waiting for memory retries on its own (loop timeouts)."""
        return self.scheduler.next_deadline()

    @property
    def cache_bytes(self) -> int:
        """H2: bytes the prompt cache holds (measured array sizes)."""
        return self.prompt_cache.nbytes

    @property
    def cache_releasable(self) -> int:
        """H3: the part no running or queued request relies on."""
        return self.prompt_cache.releasable

    def held(self) -> own_memory.Held:
        """What the prompt cache and the decode batch hold, for the worker's memory sample."""
        batch = self.decode.batch
        return own_memory.Held(self.prompt_cache.nbytes, self.prompt_cache.releasable, batch.nbytes,
                           batch.live_nbytes, batch.relayouts)

    @property
    def draft(self) -> DraftModel | None:
        return self.decode.draft

    def drop_draft(self) -> bool:
        """Under pressure the draft model goes first (worker/draft.py): its weights and every
        request's KV in it; the requests go on guessing from their text alone. False: none held."""
        if self.decode.draft is None:
            return False
        log.info("dropping the draft model %s under memory pressure", self.decode.draft.name)
        self.decode.draft = None
        for seq in self.decode.batch.rows + self.scheduler.decoding + self.decode.joining:
            if seq.spec is not None:
                seq.spec.draft = None
        return True

    def shrink_cache(self, target_bytes: int) -> int:
        """H3/P5: drop LRU unused entries toward `target_bytes`; bytes dropped (pool not yet returned)."""
        return self.prompt_cache.drop_lru(max(0, target_bytes))

    def quantize_cache(self, bits: int, target_bytes: int = 0) -> tuple[int, int]:
        """H6: quantize unused float entries (LRU first) toward `target_bytes`; (entries, bytes returned)."""
        if not self.endings.cacheable:
            return 0, 0
        return self.prompt_cache.quantize_unused(bits, max(0, target_bytes))

    def use_disk_tier(self, tier: DiskTier | None, spill_seconds: float = 0.0) -> None:
        """H5: requests read their prefix from `tier` when it has a longer one than memory, and
        what the memory tier drops while nothing runs is written there first (`spill_seconds` at most).

        Every lookup consults it (at submit, and again when the prefill starts,
        by which time the first limits have given the memory cache its cap)."""
        self.disk = tier if self.endings.cacheable else None
        self._spill_seconds = spill_seconds
        on = self.disk is not None
        self.prompt_cache.set_backing(self._read_from_disk if on else None)
        self.prompt_cache.set_spill(self._spill if on and spill_seconds > 0 else None)

    def _spill(self, victims: list[pc.Entry]) -> None:
        """H5: entries the memory tier is about to drop (an H3 shrink, a smaller H2 cap), written first
        when nothing runs: under pressure P5 and C12 empty an idle worker's cache just before P6 stops
        it, which would leave the stop nothing to write. A busy worker drops at once (its requests
        never wait on a disk); what the deadline cuts is dropped and counted."""
        if self.disk is None or self.has_work or self.running:
            return
        try:
            done = self.disk.save(victims, time.monotonic() + self._spill_seconds, given=self._spill_seconds)
        except OSError as exc:
            log.error("prompt cache not written to disk before it was dropped: %s", exc)
            return
        if done.written or done.dropped:
            log.info("prompt cache to disk before dropping: %d entries written, %d not (deadline %.3f s)",
                     done.written, done.dropped, self._spill_seconds)

    def _read_from_disk(self, prompt: Sequence[int], partition: str) -> None:
        """H5: the one disk entry this prompt needs, into the memory cache, when it beats memory's best.

        An entry larger than the memory cache's cap is not read (H2 bounds what a
        worker holds); one that cannot be read is a miss (the prefill runs). Only `partition`'s
        files are offered (H7 as proposed)."""
        tier, cache = self.disk, self.prompt_cache
        if tier is None or cache.cap <= 0:
            return
        limit = len(prompt) - 1
        found = tier.best(prompt, limit, partition=partition,
                          longer_than=max(cache.longest(prompt, limit, partition), MIN_REUSE_TOKENS - 1))
        if found is None or found.nbytes > cache.cap:
            return
        layers = tier.load(found)
        if layers is not None and cache.insert(found.tokens, layers, partition=partition):
            entry = cache.get(found.tokens, partition)
            assert entry is not None  # just inserted
            entry.disk, entry.from_disk = found.name, True

    # -- prompts ----------------------------------------------------------------------------

    def encode_chat(self, messages: Iterable, tools: str | None = None) -> list[int]:
        """Chat messages through the model's chat template, ready for the reply (worker/prompts.py)."""
        return prompts.encode_chat(self.tokenizer, messages, tools)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt; BOS added unless the text already starts with it."""
        return prompts.encode_prompt(self.tokenizer, text)

    # -- requests in ------------------------------------------------------------------------

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
        sampling: Settings | None = None,
        media: Any = None,
        partition: str = SHARED_PARTITION,
        speculative: bool = True,
    ) -> None:
        """Queue a request; it is admitted by a later `step()` (SPEC P3, P8).

        `sampling` is the whole of its sampling settings (top_k, penalties,
        logit_bias, logprobs ...); without it, temperature, top_p and seed make them.
        `media` is an image request's inputs (worker/vision.py): the request then keys the prompt
        cache on its images' hashes (`media.key`) and prefills from their embeddings.
        `partition`: the prompt-cache entries it may reuse and leaves behind (H7 as proposed).
        `speculative` False: it never guesses ahead (worker/speculate.py), even alone."""
        settings = sampling or Settings(temperature=temperature, top_p=top_p, seed=seed)
        seq = self._new_seq(request_id, prompt_tokens, max_tokens, stop, constraint, settings, partition,
                            speculative and media is None)
        if media is not None:
            seq.prompt, seq.media = list(media.key), media
        self._queue(seq)

    def _new_seq(self, request_id: str, prompt_tokens: list[int], max_tokens: int, stop: Iterable[str],
                 constraint: ConstraintSpec | None, settings: Settings, partition: str,
                 speculative: bool = False) -> Seq:
        """The request checked and made (EngineError names what is wrong), not yet queued."""
        if max_tokens < 1:
            raise EngineError(INVALID_REQUEST, f"max_tokens must be at least 1, got {max_tokens}")
        check_prompt(request_id, prompt_tokens, max_tokens, in_use=self.endings.ids,
                     context_length=self.context_length, vocab=model_vocab(self.model))
        check_sampling(settings, model_vocab(self.model))
        stops = [s for s in stop if s]
        sampler = make_request_sampler(settings, prompt_tokens)
        guesses = self.speculative and speculative and sampler is greedy and constraint is None
        return Seq(request_id, list(prompt_tokens), max_tokens, sampler,
                   StopMatcher(stops) if stops else None,
                   self._constraint(constraint, max_tokens, partition) if constraint is not None else None,
                   partition, Speculation() if guesses else None)

    def _queue(self, seq: Seq) -> None:
        self.endings.ids.add(seq.id)
        self.scheduler.queue.append(seq)
        if self.endings.cacheable:  # pinned while queued: a shrink must not take what it will reuse (H3)
            seq.hit = self.prompt_cache.lookup(seq.prompt, len(seq.prompt) - 1, partition=seq.partition)

    def submit_generate(self, cmd: Generate) -> None:
        """Queue a wire `Generate`; bad input becomes its one terminal `Failed` (next step)."""
        try:
            if cmd.images:  # the front door refuses these first; a vision model's engine takes them
                raise EngineError("model_lacks_vision", "this model reads only text; send images to a vision model")
            if cmd.echo and (cmd.messages is not None or cmd.suffix is not None):
                raise EngineError(INVALID_REQUEST, "echo: only a plain completion prompt can be echoed")
            tokens = prompt_of(self.tokenizer, cmd)
            if cmd.echo:
                self._submit_echo(cmd, tokens)
            else:
                self.submit(cmd.request_id, tokens, cmd.max_tokens, stop=cmd.stop, constraint=cmd.constraint,
                            sampling=Settings.of(cmd), partition=cmd.partition, speculative=cmd.speculative)
        except EngineError as exc:
            self._outbox.append(Failed(request_id=cmd.request_id, code=exc.code, message=exc.message))
        except Exception as exc:  # noqa: BLE001 - raised from the worker's command loop it would kill
            # the worker and every stream on it; like a failed step, it fails this request alone
            log.exception("request %s could not be prepared", cmd.request_id)
            self._outbox.append(Failed(request_id=cmd.request_id, code=ENGINE_ERROR,
                                       message=f"the request could not be prepared: {exc!r}"))

    # -- echo (worker/echo.py) ----------------------------------------------------------------

    def _submit_echo(self, cmd: Generate, tokens: list[int]) -> None:
        """An echo: its prompt scored first when logprobs are asked, then its generation queued
        (none with max_tokens 0)."""
        settings = Settings.of(cmd)
        if cmd.max_tokens > 0:
            seq: Seq | None = self._new_seq(cmd.request_id, tokens, cmd.max_tokens, cmd.stop, cmd.constraint,
                                            settings, cmd.partition)
        else:
            seq = None
            check_prompt(cmd.request_id, tokens, 0, in_use=self.endings.ids,
                         context_length=self.context_length, vocab=model_vocab(self.model))
            check_sampling(settings, model_vocab(self.model))
        self._outbox.extend(self.echoes.add(Scoring(cmd, tokens, seq)))

    def _constraint(self, spec: ConstraintSpec, max_tokens: int, partition: str) -> Constraint:
        """The request's grammar (compiled once per partition, H7 as proposed); a spec that
        cannot be enforced is invalid_request."""
        try:
            if self._constraints is None:
                vocab = model_vocab(self.model)
                self._constraints = ConstraintFactory(self.tokenizer, vocab or len(self.tokenizer.vocab))
            return self._constraints.build(spec, max_tokens, partition)
        except ConstraintError as exc:
            raise EngineError(exc.code, exc.message) from None

    # -- commands ---------------------------------------------------------------------------

    def abort(self, request_id: str, reason: str, code: FailureCode = "aborted") -> bool:
        """End one request with a terminal `Failed` (next step); False for an unknown id."""
        seq = self.scheduler.remove(request_id)
        if seq is not None:
            self._outbox.append(self.endings.fail(seq, code, reason))
            return True
        failed = self.echoes.abort(request_id, code, reason)
        if failed is None:
            return False
        self._outbox.append(failed)
        return True

    def abort_all(self, reason: str, code: FailureCode = "aborted") -> int:
        """End every request, queued ones included (P6.3, P6.5); how many were ended."""
        seqs = self.scheduler.remove_all()
        self._outbox.extend(self.endings.fail(seq, code, reason) for seq in seqs)
        echoes = self.echoes.abort_all(code, reason)
        self._outbox.extend(echoes)
        return len(seqs) + len(echoes)

    def abort_queued(self, reason: str, code: FailureCode = "aborted") -> int:
        """End the requests not yet admitted (drain: running ones finish, the rest go)."""
        seqs = self.scheduler.remove_queued()
        self._outbox.extend(self.endings.fail(seq, code, reason) for seq in seqs)
        return len(seqs)

    def memory_answer(self, request_id: str, evicted: bool) -> None:
        """The supervisor's reply to `NeedMemory`: retry the preflight once (G1)."""
        if self.scheduler.memory_answer(request_id) and not evicted:
            log.info("request %s: supervisor found nothing to evict", request_id)

    # -- before serving ---------------------------------------------------------------------

    def warm_up(self, rows: int = WARM_UP_ROWS) -> float:
        """Serve a request alone and then `rows` together, before any client waits; the seconds taken.

        Why: on a GPU the first pass of each kind pays one-time costs: kernels compile on first
        use, and cuDNN builds an attention graph per kind (causal for a lone prompt, masked for
        a padded group). On an H200 the first round with a group took 1.2-1.6 s to the first
        token for all 8 requests of it, where later rounds took ~0.1 s. The requests go through
        the real path (scheduler, prefill, group prefill, decode batch) with the guard off and
        no prompt cache, and what they would teach the engine (chunk costs, token counts) is
        put back, so serving starts from where loading left it.
        """
        started = time.monotonic()
        saved = (self.prefill.cost, self.chunk_timer.per_token, self.prefill.tokens, self.decode.tokens_total,
                 self.decode.steps)
        limits = Limits(max_concurrency=self.max_concurrency)
        prompt = self.encode_prompt("warm up " * 4)
        for count in (1, max(2, min(rows, self.max_concurrency))):
            for i in range(count):
                self.submit(f"warm-up-{count}-{i}", list(prompt), max_tokens=3)
            while self.has_work:
                self.step(limits, lambda: 0)
        (self.prefill.cost, self.chunk_timer.per_token, self.prefill.tokens, self.decode.tokens_total,
         self.decode.steps) = saved
        return time.monotonic() - started

    # -- the step ---------------------------------------------------------------------------

    def step(self, limits: Limits, usage_fn: UsageFn) -> list[Event]:
        """The outbox, then one step of the scheduler (worker/scheduler.py) under `limits`, or, turn
        about with it, one chunk of an echo's scoring (worker/echo.py): a step stays one chunk long."""
        events = self._outbox
        self._outbox = []
        if self.endings.cacheable and (limits.cache_cap != self.prompt_cache.cap
                                       or self.prompt_cache.nbytes > limits.cache_cap):
            self.prompt_cache.set_cap(limits.cache_cap)  # H2: over the cap, LRU goes
        if self.echoes.jobs and (self._score_turn or not self.scheduler.has_work):
            self._score_turn = False
            self.echoes.step(limits, usage_fn, events)
        else:
            self._score_turn = True
            self.scheduler.step(limits, usage_fn, events)
        return events


def _default_own_usage() -> int:
    return own_memory.usage()


def _default_reclaim() -> int:
    return own_memory.reclaim()
