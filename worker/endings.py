"""What a request says on its way through the engine, and how it ends.

A request tells its client three kinds of things: `Prompted` once its
prefill starts (its prompt length and cache reuse are final then), a
`TokenOut` per token (worker/decode.py), and exactly one ending, `Finished`
or `Failed`. Every path that ends a request — its last token, a stop string,
a grammar it broke, an abort, a guard refusal (G1-G3), MLX raising — goes
through `Endings`, so the request moves to `ended` once (worker/request.py
refuses a second move), its id is free again, its prompt-cache pin is
released, and what it computed is either kept for the next request (H1) or
dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Union

from mlx_lm.models.cache import KVCache

from shared.protocol import Echoed, Failed, Finished, NeedMemory, PrefillProgress, Prompted, TokenOut
from shared.vocab import FailureCode, FinishReason, LimitBinding
from worker import prefill_guard as guard
from worker import prompt_cache as pc
from worker.request import ENGINE_ERROR, Seq

log = logging.getLogger("memvisor.worker.engine")

Event = Union[TokenOut, Finished, Failed, NeedMemory, Prompted, PrefillProgress, Echoed]


def prompted(seq: Seq) -> Prompted:
    """The prompt's length and cache reuse, final once its prefill starts."""
    return Prompted(request_id=seq.id, prompt_tokens=len(seq.prompt), cached_tokens=seq.cached,
                    cached_disk_tokens=seq.cached_disk)


class Endings:
    """The one place a request ends; `ids` are the requests not yet ended."""

    def __init__(self, prompt_cache: pc.PromptCache, *, cacheable: bool, reclaim: Callable[[], int]) -> None:
        self.prompt_cache = prompt_cache
        self.cacheable = cacheable  # the model's KV is plain attention: it can be kept (H1)
        self.ids: set[str] = set()
        self._reclaim = reclaim

    @property
    def keeps_kv(self) -> bool:
        """True when a finished request's KV is worth copying out for the prompt cache."""
        return self.cacheable and self.prompt_cache.cap > 0

    def finished(self, seq: Seq, reason: FinishReason) -> Finished:
        seq.move("end")
        self.ids.discard(seq.id)
        return Finished(request_id=seq.id, finish_reason=reason, prompt_tokens=len(seq.prompt),
                        completion_tokens=seq.generated, cached_tokens=seq.cached,
                        cached_disk_tokens=seq.cached_disk,
                        stop_sequence=seq.stopper.hit if seq.stopper is not None else "")

    def store(self, seq: Seq) -> None:
        """H1: keep what the request computed (prompt and the tokens fed back) for the next one."""
        self.prompt_cache.release(seq.hit)
        seq.hit = None
        if not self.keeps_kv or not seq.cache:
            return
        first = seq.cache[0]
        if not isinstance(first, KVCache):
            return
        self.prompt_cache.insert((seq.prompt + seq.out)[:first.offset], seq.cache, partition=seq.partition)

    def fail(self, seq: Seq, code: FailureCode, message: str, **extra) -> Failed:
        seq.move("end")
        self.ids.discard(seq.id)
        self.prompt_cache.release(seq.hit)
        seq.hit = None
        seq.cache = seq.y = None
        return Failed(request_id=seq.id, code=code, message=message, **extra)

    def memory_failure(self, seq: Seq, estimated: int, limit: int, binding: LimitBinding) -> Failed:
        """G1-G3 refusal; the KV memory the request held goes back to the OS at once."""
        event = self.fail(seq, guard.PREFILL_MEMORY_EXCEEDED,
                          guard.rejection_message(estimated, limit, binding),
                          estimated_bytes=estimated, limit_bytes=limit, binding=binding or "static")
        self._reclaim()
        return event

    def engine_failure(self, seqs: list[Seq], exc: Exception, events: list[Event]) -> None:
        """MLX raised (allocation failure, bad model code): fail these requests, keep serving.

        A worker that died here would take every other request and its loaded
        model with it; failing the requests involved and returning the pool
        leaves the supervisor to decide whether the worker should go.
        """
        log.error("generation failed for %d request(s): %r", len(seqs), exc)
        for seq in seqs:
            if seq.state != "ended":
                events.append(self.fail(seq, ENGINE_ERROR, f"generation failed: {exc}"))
        self._reclaim()
