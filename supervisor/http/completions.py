"""`/v1/completions`: OpenAI's legacy text completion, as lm-evaluation-harness sends it.

lm-evaluation-harness's `local-completions` (lm_eval/models/openai_completions.py,
api_models.py) is the standard way to evaluate a model behind an OpenAI server,
and it needs three things of this route:

* **token-id prompts**: it tokenizes itself and sends `prompt: [[17872, 42, ...]]`
  (`tokenized_requests`, on by default); a prompt may be a string, a list of
  strings, a list of token ids, or a list of token-id lists;
* **several prompts per request** (its `batch_size`): each becomes a sequence
  of its own in the worker, which batches them as any concurrent requests, and
  the reply has one choice per prompt, `choices[i].index` = i (n is 1); a
  streamed reply interleaves the choices' chunks, each naming its index, then
  one usage chunk (when asked) and one `[DONE]`;
* **echo with logprobs** for its loglikelihood (every multiple-choice task):
  `echo: true, logprobs: 1, max_tokens: 1, temperature: 0`, read back as
  `logprobs.token_logprobs[ctxlen:-1]` (the prompt's continuation tokens); the
  worker scores the prompt (worker/echo.py), the first token's logprob is null
  as OpenAI's is, and `max_tokens: 0` with echo gives the prompt alone.

Its generate_until sends the task's `until` strings plus the EOS text as `stop`,
which can be more than OpenAI's 4: this route takes up to `MAX_STOPS`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from shared import protocol as p
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http import sampling_options
from supervisor.http.errors import from_serve_error
from supervisor.http.job import Job, Receive, open_job, wait_for_disconnect
from supervisor.http.metrics import Metrics
from supervisor.http.modelfacts import require_fim
from supervisor.http.openai import SSE_DONE, Completion, common_fields, refuse_unsupported
from supervisor.http.openai_types import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    BodyError,
    CompletionRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    TextCompletion,
    Usage,
    decode_body,
)
from supervisor.http.streaming import Early, Waiting, never, openai_error_event, sse_comment
from supervisor.http.tools import Planned
from supervisor.workers.streams import StreamReply

MAX_PROMPTS = 256  # prompts in one request (each is a request to the model's worker and its queue)
MAX_STOPS = 16  # stop sequences of a completion (lm-eval's until list and the EOS text)
MAX_TOKEN_ID = 2**31 - 1
Prompt = Union[str, list[int]]
_encoder = msgspec.json.Encoder()
_SHAPE = "a string, a list of strings, a list of token ids, or a list of token-id lists"


# ---------------------------------------------------------------------------
# request -> one Generate per prompt


def _token(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def prompts_of(prompt: Any) -> list[Prompt]:
    """The request's prompts: `"text"`, `["a", "b"]`, `[1, 2]` or `[[1, 2], [3]]` (strings and
    token lists may be mixed in the list form); a 400 naming what is not."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BodyError(f"prompt: {_SHAPE}", param="prompt")
    if all(_token(t) for t in prompt):
        return [list(prompt)]
    out: list[Prompt] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(_token(t) for t in item):
            out.append(list(item))
        else:
            raise BodyError(f"prompt[{i}]: a string or a non-empty list of token ids (whole numbers from 0 to "
                            f"{MAX_TOKEN_ID}); the prompt is {_SHAPE}", param="prompt")
    if len(out) > MAX_PROMPTS:
        raise BodyError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(out)}", param="prompt")
    return out


def completion_generates(req: CompletionRequest) -> list[Planned]:
    """One Generate per prompt: the prompt goes to the model as is, no template."""
    refuse_unsupported(req)
    if req.best_of not in (None, 1):
        raise BodyError("best_of: only 1 is supported", param="best_of")
    prompts = prompts_of(req.prompt)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise BodyError("max_tokens: must be at least 1 (0 only with echo: the prompt scored, nothing generated)",
                        param="max_tokens")
    if req.suffix is not None:
        if req.echo:
            raise BodyError("echo: a fill-in-the-middle prompt (suffix) cannot be echoed", param="echo")
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise BodyError("suffix: fill in the middle takes one text prompt", param="suffix")
    fields = {**common_fields(req, max_tokens, stops=MAX_STOPS), **sampling_options.completion_logprobs(req.logprobs)}
    out = []
    for prompt in prompts:
        if prompt == "" and req.suffix is None:  # fill in the middle may start at the top of a file
            raise BodyError("prompt: must not be empty", param="prompt")
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        out.append(Planned(p.Generate(prompt=text, prompt_tokens=ids, suffix=req.suffix, echo=req.echo, **fields)))
    return out


# ---------------------------------------------------------------------------
# several jobs as one


async def all_or_none(calls: list[Awaitable[Any]]) -> list[Any]:
    """Every call's result, in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()


class ClientWatch:
    """One watcher of the client for many jobs (each would otherwise read `receive` itself)."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.ensure_future(wait_for_disconnect(receive))

    async def receive(self) -> dict[str, Any]:
        await asyncio.shield(self.gone)
        return {"type": "http.disconnect"}

    def close(self) -> None:
        self.gone.cancel()


async def open_all(request: Request, sup: Supervisor, metrics: Metrics, req: CompletionRequest,
                   works: list[Planned], started: float, receive: Receive) -> list[Job]:
    """A job per prompt, all routed (the load is shared, A5); one refused ends them all."""
    opened: list[Job] = []

    async def one(work: Planned) -> Job:
        job = await open_job(request, sup, metrics, req, work, started, receive=receive)
        opened.append(job)
        return job

    try:
        return await all_or_none([one(work) for work in works])
    except BaseException:
        for job in opened:
            job.cancel("another prompt of its request was refused")
        raise


def _total(ends: list[p.Finished]) -> Usage:
    prompt, completion = sum(e.prompt_tokens for e in ends), sum(e.completion_tokens for e in ends)
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                  prompt_tokens_details=PromptTokensDetails(
                      cached_tokens=sum(e.cached_tokens for e in ends),
                      disk_cached_tokens=sum(e.cached_disk_tokens for e in ends)))
    proposed, accepted = sum(e.proposed_tokens for e in ends), sum(e.accepted_tokens for e in ends)
    if proposed:  # speculative decoding, as usage_of says it for one prompt
        usage.completion_tokens_details = CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                                                  rejected_prediction_tokens=proposed - accepted)
    return usage


def _replies(jobs: list[Job], req: CompletionRequest, works: list[Planned], include_usage: bool) -> list[Completion]:
    return [Completion(job, "text", include_usage, index=i, echo=req.echo, prompt=work.gen.prompt,
                       final=len(jobs) == 1, request_id=jobs[0].gen.request_id)
            for i, (job, work) in enumerate(zip(jobs, works))]


async def _whole(request: Request, sup: Supervisor, metrics: Metrics, req: CompletionRequest, works: list[Planned],
                 started: float) -> Response:
    watch = ClientWatch(request.receive)
    try:
        jobs = await open_all(request, sup, metrics, req, works, started, watch.receive)
        results = await all_or_none([job.collect(watch.receive) for job in jobs])
    finally:
        watch.close()
    replies = _replies(jobs, req, works, False)
    choices = [reply.text_choice(text, end) for reply, (text, _, end) in zip(replies, results)]
    body = TextCompletion(id=replies[0].id, created=replies[0].created, model=req.model,
                          usage=_total([end.finished for _, _, end in results]), choices=choices)
    return Response(_encoder.encode(body), media_type="application/json")


async def _merged(jobs: list[Job], firsts: list[StreamReply], replies: list[Completion],
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The choices' chunks as they come, interleaved; then the usage (when asked) and [DONE]."""
    out: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    async def pump(job: Job, reply: Completion, first: StreamReply) -> None:
        try:
            async for chunk in job.sse_body(reply.chunks(first)):
                out.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader below
            out.put_nowait(exc)
        finally:
            out.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(*args)) for args in zip(jobs, replies, firsts)]
    try:
        running = len(tasks)
        while running:
            item = await out.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
        ends = [reply.end for reply in replies if reply.end is not None]
        if include_usage and len(ends) == len(replies):
            yield replies[0].usage_chunk(_total(ends))
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()


async def _streamed(request: Request, sup: Supervisor, metrics: Metrics, req: CompletionRequest,
                    works: list[Planned], started: float, include_usage: bool) -> Response:
    waiting = Waiting(sup, req.model)

    async def start() -> tuple[list[Job], list[StreamReply]]:
        jobs = await open_all(request, sup, metrics, req, works, started, never)
        waiting.streams += [job.stream for job in jobs]
        try:
            return jobs, await all_or_none([job.first(never) for job in jobs])
        except BaseException:
            for job in jobs:
                job.cancel("another prompt of its request was refused")
            raise

    def render(ready: tuple[list[Job], list[StreamReply]]) -> AsyncIterator[bytes]:
        jobs, firsts = ready
        replies = _replies(jobs, req, works, include_usage)
        if len(jobs) == 1:  # one prompt: its own chunks, usage and [DONE]
            return jobs[0].sse_body(replies[0].chunks(firsts[0]))
        return _merged(jobs, firsts, replies, include_usage)

    def discard(ready: tuple[list[Job], list[StreamReply]]) -> None:
        for job in ready[0]:
            job.cancel("client disconnected")

    early = Early(start(), render, idle=lambda: sse_comment(waiting), failure=openai_error_event, discard=discard)
    return await early.response(request.receive)


async def handle(request: Request, sup: Supervisor, metrics: Metrics, body: bytes, started: float) -> Response:
    """Decode, validate, route each prompt to the model's worker, answer (JSON or SSE)."""
    req = decode_body(body, CompletionRequest)
    works = completion_generates(req)
    if req.suffix is not None:  # refused before any load where the card says no insert
        try:
            model = sup.model_config(req.model)
        except ServeError as exc:
            raise from_serve_error(exc) from None
        await require_fim(model.id, model.path)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _streamed(request, sup, metrics, req, works, started, include_usage)
    return await _whole(request, sup, metrics, req, works, started)
