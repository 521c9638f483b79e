"""The decode step: one token for every decoding request, and what each token says.

Why one step for all: every unconstrained request is a row of one
batch (worker/batch.py) and advances in the same forward pass; a model whose
KV cannot be batched (rotating, state-space caches) takes one pass per
request instead (`_single`). A request joins the batch at the first decode
step after its prefill gave it its first token, and leaves between steps.

Why one step ahead: a benchmark holds the whole path (engine + ZeroMQ +
HTTP) to plain `mlx_lm` throughput, so the step keeps mlx_lm's pipelining:
the next tokens are queued (`mx.async_eval`) before the current ones are
read, greedy sampling skips the log-softmax, and events are the wire Structs
themselves so the worker loop encodes them without copying.

Constrained requests cannot sample ahead: the mask of their next
token depends on the token still in flight. Their forward pass still runs
ahead (it needs only the lazy token) while the grammar computes the mask;
the free ones are sampled first and keep their look-ahead.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from shared.protocol import TokenOut
from worker import guess_check, speculate
from worker.batch import DecodeBatch
from worker.draft import DraftModel
from worker.endings import Endings, Event
from worker.request import Detokenizer, Seq
from worker.sampling import TokenPicker, TokenTexts, greedy

CLEAR_CACHE_EVERY = 256  # decode steps between pool returns, as mlx_lm does
KEEP_TEXT = 64  # characters of a reply a detokenizer keeps once they were read


def segment(detok: Detokenizer) -> str:
    """The text since the last read, after which the detokenizer forgets what was read.

    mlx_lm's BPE and SentencePiece streaming detokenizers keep the whole reply in
    `text` and append each token's piece with `+=` on an attribute, which CPython
    cannot do in place: every token copied the reply so far (on the 4 MB model 3.6 us
    per token over 100 tokens, 35 us over 1,000; per row, per step). They read `text`
    only to know whether anything came yet, so a non-empty tail is all they need.
    """
    text = detok.last_segment
    if type(detok) in _TRIMMABLE and detok.offset > KEEP_TEXT:  # type: ignore[attr-defined]
        tail = detok.text[-1:]  # type: ignore[attr-defined]
        detok.text, detok.offset = tail, len(tail)  # type: ignore[attr-defined]
    return text


_TRIMMABLE = (BPEStreamingDetokenizer, SPMStreamingDetokenizer)


class DecodeStep:
    """The decode batch and the requests about to join it; `run` is one step."""

    def __init__(self, model, tokenizer, endings: Endings, *, batched: bool, max_rows: int) -> None:
        self.model = model
        self.endings = endings
        self.batched = batched
        self.batch = DecodeBatch(greedy, max_rows=max_rows)
        self.joining: list[Seq] = []  # first token sampled, KV not yet in the batch
        self.steps = 0
        self.tokens_total = 0
        self._eos = frozenset(tokenizer.eos_token_ids)
        self.texts = TokenTexts(tokenizer)  # the logprobs name tokens by their text
        self.draft: DraftModel | None = None  # guesses free text for a request decoding alone
        self.checked = 0  # checked steps so far
        self._plain_before = False  # the last step was a plain one of one row (its pass is the next one's wait)
        self.costs = speculate.Costs()  # what passes of one row cost here: plain, and checks by size

    def join(self, seq: Seq) -> None:
        """A request that has its first token decodes from the next step on."""
        if self.batched:
            self.joining.append(seq)

    def leave(self, seq: Seq) -> None:
        """Between steps: an aborted request's row goes out of the batch."""
        if seq in self.joining:
            self.joining.remove(seq)
        else:
            self.batch.remove(seq)

    def clear(self) -> None:
        """Nobody decodes any more (abort all, or the step raised)."""
        self.joining.clear()
        self.batch.clear()

    def run(self, decoding: list[Seq], events: list[Event]) -> list[Seq]:
        """One token for every request in `decoding`; the ones that go on."""
        started = time.perf_counter()
        alone = self.batched and len(self.batch) == 1 and not self.joining
        checked = self.checked
        survivors = self._batched(events) if self.batched else self._single(decoding, events)
        plain = alone and self.checked == checked and bool(survivors)
        if plain and self._plain_before:  # a plain step of one row after another waits for one pass
            self.costs.learn_plain(time.perf_counter() - started)
        self._plain_before = plain
        self.steps += 1
        if self.steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return survivors

    def _batched(self, events: list[Event]) -> list[Seq]:
        """Joiners in, one batched pass queued, the previous tokens read at once, leavers out.

        A constrained row's next token waits for its mask, which needs the
        token just read: its sample is drawn after the read, from the same
        logits, and written into its place; the free rows keep their look-ahead.
        """
        batch = self.batch
        joining, self.joining = self.joining, []
        batch.join(joining, [seq.kv() for seq in joining], [seq.token() for seq in joining])
        for seq in joining:
            seq.cache = seq.y = None  # the batch holds its KV and token now
        checked = self._checked(events) if len(batch) == 1 else None
        if checked is not None:
            return checked
        logits = following = None
        if batch and any(seq.resuming or seq.generated + 1 < seq.max_tokens for seq in batch.rows):
            with mx.stream(generation_stream):
                logits, following = batch.forward(self.model)
        if not batch:
            return []
        keep, survivors, late, ended = [], [], [], []
        for i, (seq, token) in enumerate(zip(batch.rows, batch.tokens())):
            if seq.resuming:
                seq.resuming = False  # its last prompt token went in: this pass sampled its first token
            elif self.emit(seq, token, events):
                ended.append(i)
                continue
            keep.append(i)
            survivors.append(seq)
            if seq.constraint is not None and logits is not None:
                with mx.stream(generation_stream):
                    late.append(([i], seq.sample(seq.constraint.mask(logits[i:i + 1]))))
        if late:
            assert following is not None  # a late row had logits, so the pass ran
            with mx.stream(generation_stream):
                following = batch.place(following, late)
        self._store(ended)
        batch.keep(keep, following)
        return survivors

    def _checked(self, events: list[Event]) -> list[Seq] | None:
        """A speculative step of the batch's only row (worker/speculate.py): its token in flight
        and the guesses that follow it checked in one pass; None when it does not guess this
        step (it may not, nothing was found, or a check would not pay: speculate.Odds) and the
        plain step runs."""
        seq = self.batch.rows[0]
        spec = seq.spec
        room = seq.max_tokens - seq.generated - 2  # the token in flight and the next one come too
        if spec is None or seq.resuming or seq.constraint is not None or room <= 0:
            return None
        drafter = spec.drafter
        if drafter is None:
            drafter = spec.drafter = speculate.NgramDrafter(seq.prompt)
        drafter.extend(seq.out[len(drafter.tokens) - len(seq.prompt):])
        first = self.batch.tokens()[0]
        drafter.append(first)
        odds = spec.odds
        at = len(drafter.tokens)  # where the next token goes
        odds.saw(first, at - 1)
        most = min(speculate.MAX_DRAFT, room)
        proposal = drafter.propose(most)
        drafts = proposal[:odds.length(self.costs, len(proposal))] if proposal else []
        if not drafts:  # a plain step: its token will tell whether the guess was right
            odds.guessed(proposal[0] if proposal else None, at)
            if not proposal and self.draft is not None:  # the text holds no guess: the draft model's, where they pay
                odds = spec.draft_odds
                want = odds.length(self.costs, most)
                if want:
                    spec.draft = spec.draft or self.draft.state()
                    drafts = self.draft.propose(spec.draft, drafter.tokens, want)
        if not drafts:
            return None
        self.checked += 1
        ended = guess_check.verify(self.model, self.batch, seq, first, drafts, self.emit, events, self.costs, odds)
        if spec.draft is not None:  # its KV keeps the tokens the model kept, not the rejected guesses
            DraftModel.rewind(spec.draft, len(seq.prompt) + len(seq.out))
        if ended:
            self._store([0])
            self.batch.keep([], None)
            return []
        return [seq]

    def _store(self, ended: list[int]) -> None:
        """H1: the KV of the rows that ended, copied out in one evaluation (not one per row:
        on a GPU each is a wait for the device), kept for the next request."""
        batch = self.batch
        layers: list[list[KVCache] | None] = [None] * len(ended)
        if ended and self.endings.keeps_kv:
            layers = list(batch.extract(ended))
        for i, kv in zip(ended, layers):
            seq = batch.rows[i]
            seq.cache = kv
            self.endings.store(seq)
            seq.cache = None

    def _single(self, decoding: list[Seq], events: list[Event]) -> list[Seq]:
        """One pass per request (no batching): for KV that cannot be batched."""
        seqs = [seq for seq in decoding if seq.constraint is None]
        bound = [seq for seq in decoding if seq.constraint is not None]
        following: list[mx.array | None] = []
        with mx.stream(generation_stream):
            for seq in seqs:
                if seq.generated + 1 < seq.max_tokens:
                    logits = self.model(seq.token()[None], cache=seq.cache)[:, -1, :]
                    following.append(seq.sample(logits))
                else:
                    following.append(None)
        mx.async_eval([y for y in following if y is not None])
        survivors = self._constrained(bound, events) if bound else []
        for seq, nxt in zip(seqs, following):
            if self.emit(seq, seq.token_id(), events):
                self.endings.store(seq)
                seq.cache = seq.y = None
            else:
                seq.y = nxt
                survivors.append(seq)
        return survivors

    def _constrained(self, seqs: list[Seq], events: list[Event]) -> list[Seq]:
        """Queue the forward passes, then read each token and advance its grammar
        while they run, then queue the masked samples (only sampling waits for the mask)."""
        with mx.stream(generation_stream):
            ahead = [self.model(seq.token()[None], cache=seq.cache)[:, -1, :]
                     if seq.generated + 1 < seq.max_tokens else None for seq in seqs]
        mx.async_eval([logits for logits in ahead if logits is not None])
        survivors, following = [], []
        for seq, logits in zip(seqs, ahead):
            if self.emit(seq, seq.token_id(), events):
                seq.cache = seq.y = None
                continue
            # a constrained request that did not end had room for one more token: its pass ran
            assert seq.constraint is not None and logits is not None
            with mx.stream(generation_stream):
                seq.y = seq.sample(seq.constraint.mask(logits))
            following.append(seq.y)
            survivors.append(seq)
        mx.async_eval(following)
        return survivors

    @staticmethod
    def _reports(seq: Seq) -> bool:
        """The request asked for its tokens' logprobs."""
        picker = seq.sample
        return type(picker) is TokenPicker and picker.top >= 0

    def _token(self, seq: Seq, text: str, token: int) -> TokenOut:
        """The token's event, with its logprobs when its request asked."""
        picker = seq.sample
        if type(picker) is TokenPicker and picker.top >= 0:
            return TokenOut(request_id=seq.id, text=text, token_id=token, logprobs=picker.take(token, self.texts))
        return TokenOut(request_id=seq.id, text=text, token_id=token)

    def emit(self, seq: Seq, token: int, events: list[Event]) -> bool:
        """Turn one sampled token into events; True when the request ended."""
        seq.generated += 1
        seq.out.append(token)
        self.tokens_total += 1
        detok = seq.detok
        assert detok is not None  # set when the request got its first token
        if token in self._eos:
            detok.finalize()
            text = segment(detok)
            if seq.stopper is not None:
                text, hit = seq.stopper.feed(text)
                text = text if hit else text + seq.stopper.flush()
            if self._reports(seq):  # the EOS is a completion token: its logprob too (its text never shows)
                events.append(self._token(seq, text, token))
            elif text:
                events.append(TokenOut(request_id=seq.id, text=text))
            events.append(self.endings.finished(seq, "stop"))
            return True
        detok.add_token(token)
        complete = False  # the grammar of a constrained output is satisfied
        if seq.constraint is not None:
            if not seq.constraint.accept(token):
                events.append(self.endings.fail(seq, seq.constraint.error_code, seq.constraint.error))
                return True
            complete = seq.constraint.done
        last = seq.generated >= seq.max_tokens or complete
        if last:
            detok.finalize()
        text = segment(detok)
        if seq.stopper is not None:
            text, hit = seq.stopper.feed(text)
            if hit:
                events.append(self._token(seq, text, token))
                events.append(self.endings.finished(seq, "stop"))
                return True
            if last:
                text += seq.stopper.flush()
        events.append(self._token(seq, text, token))
        if last:
            # a grammar the budget had to wrap up ends as "length", though its output is complete
            wrapped = complete and seq.constraint is not None and seq.constraint.wrapped
            events.append(self.endings.finished(seq, "stop" if complete and not wrapped else "length"))
            return True
        return False
