"""Ollama's `/api/pull` and `/api/delete`: a model from the Hugging Face hub, and its removal.

`POST /api/pull {"model": "ORG/NAME[:TAG][@REVISION]", "stream": true}`. What
can be refused is refused before any byte is fetched, with a status: 400 a
name that is not a hub repo (a URL, a path, `..`) or a repo with nothing
memvisor serves, 403 a gated repo, 404 one the hub does not have, 502 a hub
that cannot be reached, 507 a model that could never fit under this
machine's ceiling (supervisor.models.hub_fit, from this supervisor's own status).
Then, streamed as Ollama streams (`application/x-ndjson`, its clients'
`ProgressResponse`): `{"status": "pulling manifest"}`, per file
`{"status": "pulling <file>", "digest": "sha256:...", "total": N,
"completed": M}`, `{"status": "verifying sha256 digest"}`, `{"status":
"writing manifest"}` and `{"status": "success"}` once the model is served; a
failure after the first line is a last line `{"error": "..."}` (the clients
raise it). With `"stream": false` one `{"status": "success"}`.

The download runs on a daemon thread (the loop never waits on the hub or the
disk) and reports through the loop; a client that goes away cancels it at
the next chunk, and what was fetched stays for the next pull to resume.
When it is done the supervisor reloads, which serves the model (discovery
adds what was pulled).

`DELETE /api/delete {"model": ...}` removes a pulled model: it leaves the
catalogue through a reload (a loaded one is drained and stopped as any
removed model is), then its files leave the cache (supervisor.models.pulled). A
model of the config or a models folder is the user's own: 409, never deleted.

Both change what this server serves, so both are admin routes (http/auth.py
`require_admin`: the admin token when one is set), behind the gate like
every state-changing route (a JSON body, an allowed Origin and Host).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http.auth import require_admin
from supervisor.http.errors import ApiError
from supervisor.http.job import race_client
from supervisor.http.openai_types import BodyError, decode_body
from supervisor.models import pulled
from supervisor.models.hub_fetch import Cancelled, Step
from supervisor.models.hub_fetch import pull as fetch_and_record
from supervisor.models.hub_fit import refusal, room_from_status
from supervisor.models.hub_repo import HubError, Plan, RefError, parse_ref, plan_for, quiet_transport_logs
from supervisor.wiring.offloop import OffLoopTimeout, off_loop

log = logging.getLogger("memvisor.http")

_encoder = msgspec.json.Encoder()
LISTING_SECONDS = 90.0   # the hub's listing and a GGUF header, before a pull starts
FILES_SECONDS = 300.0    # the record and the cache's files, for a delete
RELOAD_BUSY_SECONDS = 60.0
REPORT_EVERY = 0.25      # seconds between two progress lines of one file


class PullBody(msgspec.Struct, kw_only=True):
    model: Union[str, None] = None
    name: Union[str, None] = None  # the older spelling
    insecure: Union[bool, None] = None
    stream: bool = True


class DeleteBody(msgspec.Struct, kw_only=True):
    model: Union[str, None] = None
    name: Union[str, None] = None


def _name(body: PullBody | DeleteBody) -> str:
    name = body.model or body.name
    if not name:
        raise BodyError("model: required (ORG/NAME on the Hugging Face hub)", param="model")
    return name


def _line(body: dict[str, Any]) -> bytes:
    return _encoder.encode(body) + b"\n"


def _hub_error(exc: HubError) -> ApiError:
    code = {404: "model_not_found", 403: "forbidden"}.get(exc.status, "unavailable")
    return ApiError(exc.status, str(exc), code=code)  # type: ignore[arg-type]


async def _plan(name: str) -> Plan:
    try:
        ref = parse_ref(name)
    except RefError as exc:
        raise ApiError(400, str(exc), code="invalid_request", param="model") from None
    quiet_transport_logs()
    try:
        return await off_loop(lambda: plan_for(ref), LISTING_SECONDS, "hub-listing")
    except RefError as exc:
        raise ApiError(400, str(exc), code="invalid_request", param="model") from None
    except HubError as exc:
        raise _hub_error(exc) from None
    except OffLoopTimeout:
        raise ApiError(504, f"the hub did not describe {name} within {LISTING_SECONDS:.0f} s", code="timeout") from None


async def handle_pull(request: Request, sup: Supervisor, body: bytes) -> Response:
    require_admin(request, sup.config.supervisor.admin_token)
    req = decode_body(body, PullBody)
    plan = await _plan(_name(req))
    why = refusal(plan, room_from_status(sup.server_status().guard))
    if why is not None:
        raise ApiError(507, f"refused before downloading: {why}", code="model_too_large")
    job = PullJob(plan)
    if req.stream:
        return StreamingResponse(_progress(job, sup), media_type="application/x-ndjson")
    try:
        await race_client(job.finished(), request.receive)
    except BaseException:
        job.cancel.set()
        raise
    await _serve(sup, plan.ref.model_id)
    return Response(_encoder.encode({"status": "success"}), media_type="application/json")


class PullJob:
    """One download on its own thread, reporting to the loop: its steps, then the entry or the error."""

    def __init__(self, plan: Plan) -> None:
        self.model_id = plan.ref.model_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Step | pulled.Pulled | BaseException] = asyncio.Queue()
        self.cancel = threading.Event()
        self._sent: dict[tuple[str, str], float] = {}
        threading.Thread(target=self._work, args=(plan,), name="memvisor-pull", daemon=True).start()

    def _post(self, item: Step | pulled.Pulled | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop closed (shutdown): nobody is listening
            self.cancel.set()

    def _step(self, step: Step) -> None:
        """Throttled: a line a file every REPORT_EVERY seconds, and its first and last."""
        key, now = (step.file, step.phase), time.monotonic()
        last = self._sent.get(key)
        if last is None or step.done >= step.size or now - last >= REPORT_EVERY:
            self._sent[key] = now
            self._post(step)

    def _work(self, plan: Plan) -> None:
        try:
            self._post(fetch_and_record(plan, self._step, self.cancel))
        except BaseException as exc:  # handed to the loop, said there
            self._post(exc)

    async def steps(self) -> AsyncIterator[Step]:
        """The steps until the end; raises what the download raised."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Step):
                yield item
            elif isinstance(item, BaseException):
                raise item
            else:
                return

    async def finished(self) -> None:
        try:
            async for _step in self.steps():
                pass
        except HubError as exc:
            raise _hub_error(exc) from None
        except (OSError, pulled.RecordError) as exc:
            raise ApiError(500, _said(exc), code="internal_error") from None


async def _progress(job: PullJob, sup: Supervisor) -> AsyncIterator[bytes]:
    """Ollama's progress lines; the download is cancelled when the client goes away."""
    said: set[str] = set()
    words = {"verifying": "verifying sha256 digest", "linking": "writing manifest"}
    try:
        yield _line({"status": "pulling manifest"})
        async for step in job.steps():
            if step.phase == "pulling":
                line: dict[str, Any] = {"status": f"pulling {step.file}", "total": step.size, "completed": step.done}
                if step.digest:
                    line["digest"] = step.digest
                yield _line(line)
            elif step.phase not in said:  # once each, as Ollama says them
                said.add(step.phase)
                yield _line({"status": words[step.phase]})
        await _serve(sup, job.model_id)
        yield _line({"status": "success"})
    except Cancelled:
        return
    except (HubError, ApiError, ServeError, OSError, pulled.RecordError) as exc:
        yield _line({"error": _said(exc)})
    finally:
        job.cancel.set()


def _said(exc: BaseException) -> str:
    """A failure in words; a disk's OSError keeps its reason (ENOSPC says the disk is full)."""
    if isinstance(exc, OSError):
        return f"pull failed: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
    return str(exc)


async def _serve(sup: Supervisor, model_id: str) -> None:
    """Reload so the pulled model is served (a reload already reading is waited for)."""
    deadline = time.monotonic() + RELOAD_BUSY_SECONDS
    while True:
        try:
            words = await sup.reload(f"pulled {model_id}")
            log.info("pulled %s: %s", model_id, words)
            return
        except ServeError as exc:
            if exc.code != "reload_busy" or time.monotonic() > deadline:
                raise ApiError(500 if exc.code != "reload_unsupported" else 409,
                               f"pulled {model_id}, but it is not served yet: {exc}", code=exc.code) from None
            await asyncio.sleep(0.5)


async def handle_delete(request: Request, sup: Supervisor, body: bytes) -> Response:
    require_admin(request, sup.config.supervisor.admin_token)
    name = _name(decode_body(body, DeleteBody))
    try:
        models = await off_loop(pulled.read, FILES_SECONDS, "pull-record")
    except (OSError, pulled.RecordError) as exc:
        raise ApiError(500, str(exc), code="internal_error") from None
    entry = pulled.find(name, models)
    if entry is None:
        if sup.config.model(name) is not None or sup.config.model(name.removesuffix(":latest")) is not None:
            raise ApiError(409, f"{name} was not pulled: it is served from your config or a models folder, "
                                "which memvisor never deletes (remove it there, then reload)", code="conflict")
        raise ApiError(404, f"model '{name}' not found among the pulled models", code="model_not_found")
    try:
        left = await off_loop(lambda: pulled.forget(entry), FILES_SECONDS, "pull-record")
    except (OSError, pulled.RecordError) as exc:
        raise ApiError(500, f"cannot update the pull record: {exc}", code="internal_error") from None
    try:
        log.info("deleted %s: %s", entry.id, await sup.reload(f"deleted {entry.id}"))
    except ServeError as exc:
        log.warning("deleted %s, but the reload was refused (%s): it is served until a reload", entry.id, exc)
    try:
        words = await off_loop(lambda: pulled.delete_files(entry, left), FILES_SECONDS, "pull-delete")
    except (OSError, OffLoopTimeout) as exc:
        raise ApiError(500, f"{entry.id} is no longer served, but its files stay: {exc}",
                       code="internal_error") from None
    return Response(_encoder.encode({"status": "success", "model": entry.id, "detail": words}),
                    media_type="application/json")
