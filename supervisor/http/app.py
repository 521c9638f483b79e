"""The HTTP front door's routes: OpenAI-compatible endpoints and the others beside them.

Starlette rather than FastAPI: the bodies are msgspec Structs validated by
msgspec, so FastAPI's pydantic layer would only add a second validator and
its import cost. http/server.py serves these routes in the supervisor's own
loop. The front door sees the supervisor only through `supervisor.doors.api.Supervisor`.

Endpoints (docs/api.md):
  GET  /health                      200, or 503 while a pinned model is not ready
  GET  /health?model=ID             that model's readiness, status as a request would get
  GET  /status                      SPEC S1 + the PUB endpoint
  GET  /metrics                     Prometheus text
  GET  /v1/models, /v1/models/{id}
  POST /v1/chat/completions, /v1/completions   (JSON or SSE with "stream": true)
  POST /v1/messages                 Anthropic Messages (http/anthropic.py)
  POST /v1/responses                OpenAI Responses (http/responses.py)
  POST /v1/models/{id}/load|unload  admin
  POST /admin/guard                 admin; SPEC T6 (tier, custom ceiling, on/off)
  GET  /v1/events                   the PUB topics as SSE (supervisor.http.events)
  GET  /, /ui, /ui/*                the dashboard (supervisor.http.dashboard)
  POST /v1/messages/count_tokens    Anthropic token counting
  GET  /api/version, /api/tags, /api/ps; POST /api/show, /api/chat, /api/generate
                                    the Ollama API (http/ollama.py)
  POST /api/pull, DELETE /api/delete  admin; models from the Hugging Face hub (http/ollama_pull.py)
  /chat/completions, /completions, /models, /messages: the /v1 routes for clients
  that leave the prefix out
  POST /tokenize, /detokenize       llama.cpp's token routes (http/tokenize.py)
  POST /infill                      llama.cpp's fill in the middle, for editor plugins (http/infill.py)
  POST /v1/embeddings (and /embeddings), /api/embed, /api/embeddings
                                    embeddings (http/embeddings.py)

Who may administer (load, unload, /admin/guard): http/auth.py, with the API
keys (with `[supervisor] api_keys` every /v1 call needs one). Every request first passes the gate
(http/browser_guard.py: Host, Origin, Content-Type, CORS) and the connection limits
(http/connection_limits.py: header/body deadlines, a connection cap).
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared import protocol as p
from shared.sizes import SizeError, parse_size
from shared.vocab import ErrorCode
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http import anthropic as http_anthropic
from supervisor.http import completions as http_completions
from supervisor.http import embeddings as http_embeddings
from supervisor.http import infill as http_infill
from supervisor.http import ollama as http_ollama
from supervisor.http import ollama_models, ollama_pull
from supervisor.http import openai as http_openai
from supervisor.http import responses as http_responses
from supervisor.http import tokenize as http_tokenize
from supervisor.http.auth import ApiKeys, EventTickets, require_admin
from supervisor.http.body import Disconnected, read_body
from supervisor.http.dashboard import Dashboard
from supervisor.http.errors import ApiError, from_serve_error
from supervisor.http.events import EventsEndpoint
from supervisor.http.images import body_limit as images_body_limit
from supervisor.http.job import race_client
from supervisor.http.keepalive import is_admin
from supervisor.http.metrics import Metrics
from supervisor.http.modelfacts import ModelFacts, capabilities, facts_of
from supervisor.http.openai_types import BodyError, GuardSettingsIn, ModelCard, ModelList, decode_body
from supervisor.wiring.control_answers import MAX_CONTEXT_TOKENS

log = logging.getLogger("memvisor.http")

_encoder = msgspec.json.Encoder()


class UnloadBody(msgspec.Struct, kw_only=True):
    id: str
    unloaded: bool
    object: str = "model"


def json_response(body, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


# ---------------------------------------------------------------------------
# the app


class FrontDoor:
    """Route handlers bound to one supervisor."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.scfg = sup.config.supervisor
        self.metrics = Metrics(sup)
        self.created = int(time.time())
        self.keys = ApiKeys.from_config(self.scfg)  # with none configured, /v1 is open
        self.tickets = EventTickets()  # the dashboard's EventSource, with no key in its URL

    # -- models ---------------------------------------------------------------

    def card(self, model, facts: ModelFacts) -> ModelCard:
        """With the context length and the capabilities its files show (as /api/show's)."""
        info = self.sup.model_info(model.id)
        return ModelCard(id=model.id, created=self.created, state=info.state, pinned=model.pinned,
                         worker=info.worker or None, pid=info.pid or None, context_length=facts.context_length,
                         capabilities=card_capabilities(facts), memvisor=info,
                         readiness=self.sup.readiness(model.id))

    async def cards(self, models) -> list[ModelCard]:
        facts = await facts_of([m.path for m in models])  # the model's small files, read off the loop
        return [self.card(m, facts[m.path]) for m in models]

    async def models(self, request: Request) -> Response:
        return json_response(ModelList(data=await self.cards(self.sup.config.models)))

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        action = model_id.rpartition("/")[2]
        if action in ("load", "unload") and self.sup.config.model(model_id) is None:
            raise ApiError(405, f"{action} takes POST, not {request.method}", code="method_not_allowed",
                           headers={"Allow": "POST"})
        model = self._model_config(model_id)
        return json_response((await self.cards([model]))[0])

    def _model_config(self, model_id: str):
        try:
            return self.sup.model_config(model_id)
        except ServeError as exc:
            raise from_serve_error(exc) from None

    async def load(self, request: Request) -> Response:
        """POST /v1/models/{id}/load; `?dry_run=true[&context=N]` answers "will it fit?" only."""
        require_admin(request, self.scfg.admin_token)
        model = self._model_config(request.path_params["model_id"])
        if request.query_params.get("dry_run", "").lower() in ("1", "true", "yes"):
            raw = request.query_params.get("context", "0")
            if not raw.isdigit() or len(raw) > 10 or int(raw) > MAX_CONTEXT_TOKENS:  # as the CLI's
                raise ApiError(400, f"context must be a whole number of tokens, 0..{MAX_CONTEXT_TOKENS}, got "
                               f"{raw[:40]!r}", code="invalid_request", param="context")
            try:
                return json_response(await self.sup.fit(model.id, int(raw)))
            except ServeError as exc:
                raise from_serve_error(exc) from None
        try:
            await race_client(self.sup.load(model.id, explicit=True), request.receive)
        except ServeError as exc:
            raise from_serve_error(exc) from None
        return json_response((await self.cards([model]))[0])

    async def unload(self, request: Request) -> Response:
        require_admin(request, self.scfg.admin_token)
        model = self._model_config(request.path_params["model_id"])
        try:
            done = await self.sup.unload(model.id, "unloaded over HTTP", admin=True)
        except ServeError as exc:
            raise from_serve_error(exc) from None
        return json_response(UnloadBody(id=model.id, unloaded=done))

    # -- generation -----------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, self._body_limit(), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_openai.handle(request, self.sup, self.metrics, body, started)

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_completions.handle(request, self.sup, self.metrics, body, started)

    def _body_limit(self) -> int:
        """`max_body`, plus room for the images a route that takes them may carry (http/images.py)."""
        return images_body_limit(self.scfg)

    async def messages(self, request: Request) -> Response:
        body = await read_body(request, self._body_limit(), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_anthropic.handle(request, self.sup, self.metrics, body, started)

    async def responses(self, request: Request) -> Response:
        body = await read_body(request, self._body_limit(), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_responses.handle(request, self.sup, self.metrics, body, started)

    async def embeddings(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return await http_embeddings.handle_openai(request, self.sup, self.metrics, body)

    async def ollama_embed(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_embeddings.handle_embed(request, self.sup, self.metrics, body, started)

    async def ollama_embeddings(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return await http_embeddings.handle_embeddings(request, self.sup, self.metrics, body)

    async def count_tokens(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_anthropic.count_tokens(request, self.sup, self.metrics, body, started)

    # -- llama.cpp's token routes (http/tokenize.py) ----------------------------

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return await http_tokenize.tokenize(self.sup, body)

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return await http_tokenize.detokenize(self.sup, body)

    async def infill(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_infill.handle(request, self.sup, self.metrics, body, started)

    # -- the Ollama API ---------------------------------------------------------

    async def ollama_version(self, request: Request) -> Response:
        return json_response({"version": ollama_models.VERSION})

    async def ollama_tags(self, request: Request) -> Response:
        return json_response(await ollama_models.tags(self.sup))

    async def ollama_ps(self, request: Request) -> Response:
        return json_response(await ollama_models.ps(self.sup))

    async def ollama_show(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return json_response(await ollama_models.show(self.sup, body))

    async def ollama_chat(self, request: Request) -> Response:
        body = await read_body(request, self._body_limit(), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_ollama.handle_chat(request, self.sup, self.metrics, body, started)

    async def ollama_generate(self, request: Request) -> Response:
        body = await read_body(request, self._body_limit(), self.scfg.body_timeout)
        started = request.scope.get("memvisor.started", time.monotonic())
        return await http_ollama.handle_generate(request, self.sup, self.metrics, body, started)

    async def ollama_pull(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return await ollama_pull.handle_pull(request, self.sup, body)

    async def ollama_delete(self, request: Request) -> Response:
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        return await ollama_pull.handle_delete(request, self.sup, body)

    async def ollama_no_hub(self, request: Request) -> Response:
        raise ollama_models.no_hub(request.url.path)

    # -- guard ----------------------------------------------------------------

    async def status(self, request: Request) -> Response:
        """SPEC S1 plus the PUB endpoint, models, recent events (supervisor.policy.status.ServerStatus)."""
        return json_response(self.sup.server_status())

    async def guard(self, request: Request) -> Response:
        """SPEC T6: new settings take effect at once (the enforcer ticks)."""
        require_admin(request, self.scfg.admin_token)
        body = await read_body(request, int(self.scfg.max_body), self.scfg.body_timeout)
        new = decode_body(body, GuardSettingsIn)
        sizes: dict[str, int | None] = {}
        for name in ("custom_ceiling", "custom_device_ceiling"):
            value = getattr(new, name)
            try:
                sizes[name] = None if value is None else parse_size(value)
            except SizeError as exc:
                raise BodyError(f"{name}: {exc}", param=name) from None
        try:
            self.sup.update_guard(p.GuardUpdate(tier=new.tier, enabled=new.enabled, custom_ceiling=sizes["custom_ceiling"],
                                                custom_device_ceiling=sizes["custom_device_ceiling"]))
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_guard_settings") from None
        return json_response(self.sup.server_status())

    async def health(self, request: Request) -> Response:
        """503 while a pinned model is on its way up: `failed` when one gave up, else `loading`;
        a pinned model an admin unloaded is listed under `unloaded` (supervisor/guard/readiness.py).

        `?model=ID`: that model's readiness, with the status a request for it
        would get now (200, 429, 503 or 507) and its Retry-After: a router's cheap probe."""
        if "model" in request.query_params:
            return self.model_health(request.query_params["model"])
        health = self.sup.health()
        return json_response(health, 503 if health.waiting else 200)

    def model_health(self, name: str) -> Response:
        try:
            ready = self.sup.readiness(name)
        except ServeError as exc:
            raise from_serve_error(exc) from None
        headers = {"Retry-After": str(ready.retry_after)} if ready.retry_after is not None else None
        return Response(_encoder.encode(ready), status_code=ready.status, headers=headers,
                        media_type="application/json")

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- access ---------------------------------------------------------------

    def read_access(self, request: Request) -> None:
        """/v1/events: a /v1 call, so it needs an API key when keys are set;
        /status and /metrics stay open, like /health. EventSource sends no headers: the
        dashboard's ticket cookie (set by POST /ui/ticket) opens it, and
        `?api_key=` still does for older clients (the dashboard never sends it)."""
        if self.keys.enabled and self.tickets.valid(request.cookies.get(EventTickets.COOKIE, "")):
            return
        self.keys.check(request, from_query=True)

    def may_admin(self, request: Request) -> bool:
        return is_admin(request, self.scfg.admin_token)

    # -- wiring ---------------------------------------------------------------

    def routes(self) -> list[Route]:
        r = guarded

        def v(handler, shape=ApiError.response):  # /v1 needs an API key when keys are set
            return guarded(self.keys.required(handler), shape)

        def o(handler):  # the Ollama API, keyed like /v1, errors in Ollama's shape
            return v(handler, http_ollama.error_response)

        anthropic = http_anthropic.error_response
        return [
            Route("/v1/events", EventsEndpoint(self.sup, self.read_access), methods=["GET"]),
            *Dashboard(self.sup, self.may_admin, self.keys, self.tickets).routes(r),
            Route("/health", r(self.health), methods=["GET"]),
            Route("/status", r(self.status), methods=["GET"]),
            Route("/metrics", r(self.metrics_text), methods=["GET"]),
            Route("/v1/models", v(self.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}/load", v(self.load), methods=["POST"]),
            Route("/v1/models/{model_id:path}/unload", v(self.unload), methods=["POST"]),
            Route("/v1/models/{model_id:path}", v(self.model), methods=["GET"]),
            Route("/v1/chat/completions", v(self.chat), methods=["POST"]),
            Route("/v1/completions", v(self.completions), methods=["POST"]),
            Route("/v1/messages", v(self.messages, anthropic), methods=["POST"]),
            Route("/v1/messages/count_tokens", v(self.count_tokens, anthropic), methods=["POST"]),
            Route("/v1/responses", v(self.responses), methods=["POST"]),
            Route("/v1/embeddings", v(self.embeddings), methods=["POST"]),
            Route("/embeddings", v(self.embeddings), methods=["POST"]),
            # clients that leave out /v1 reach the same handlers
            Route("/models", v(self.models), methods=["GET"]),
            Route("/chat/completions", v(self.chat), methods=["POST"]),
            Route("/completions", v(self.completions), methods=["POST"]),
            Route("/messages", v(self.messages, anthropic), methods=["POST"]),
            Route("/messages/count_tokens", v(self.count_tokens, anthropic), methods=["POST"]),
            Route("/tokenize", v(self.tokenize), methods=["POST"]),  # llama.cpp's
            Route("/detokenize", v(self.detokenize), methods=["POST"]),
            Route("/infill", v(self.infill), methods=["POST"]),
            # the Ollama API (its version check carries no data, so it needs no key)
            Route("/api/version", guarded(self.ollama_version, http_ollama.error_response), methods=["GET"]),
            Route("/api/tags", o(self.ollama_tags), methods=["GET"]),
            Route("/api/ps", o(self.ollama_ps), methods=["GET"]),
            Route("/api/show", o(self.ollama_show), methods=["POST"]),
            Route("/api/chat", o(self.ollama_chat), methods=["POST"]),
            Route("/api/generate", o(self.ollama_generate), methods=["POST"]),
            Route("/api/embed", o(self.ollama_embed), methods=["POST"]),
            Route("/api/embeddings", o(self.ollama_embeddings), methods=["POST"]),
            Route("/api/pull", o(self.ollama_pull), methods=["POST"]),  # admin (http/ollama_pull.py)
            Route("/api/delete", o(self.ollama_delete), methods=["DELETE"]),
            *[Route(path, o(self.ollama_no_hub), methods=["POST", "DELETE", "HEAD"])
              for path in ("/api/push", "/api/create", "/api/copy", "/api/blobs/{digest}")],
            Route("/admin/guard", r(self.guard), methods=["POST"]),
        ]


def card_capabilities(facts: ModelFacts) -> list[str]:
    """/api/show's capabilities (http/ollama.py), with `chat` where a chat template makes
    /v1/chat/completions usable: one list for both APIs, so they never disagree."""
    caps = capabilities(facts)
    return [*caps, "chat"] if facts.has_template and "chat" not in caps else caps


def guarded(handler: Callable[[Request], Awaitable[Response]],
            shape: Callable[[ApiError], Response] = ApiError.response) -> Callable[[Request], Awaitable[Response]]:
    """Every failure becomes JSON in the API's own error shape (OpenAI's unless `shape`
    says otherwise, e.g. Anthropic's); a bug is logged here, never shown."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return shape(exc)
        except BodyError as exc:
            return shape(ApiError(400, str(exc), code="invalid_request", param=exc.param))
        except Disconnected:
            return Response(status_code=499)  # nobody is listening; keeps the log honest
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.url.path)
            return shape(ApiError(500, "internal error in the front door; the supervisor's log has the details",
                                  code="internal_error"))

    return endpoint


_ROUTER_CODES: dict[int, ErrorCode] = {404: "unknown_endpoint", 405: "method_not_allowed"}


async def http_exception(request: Request, exc: Exception) -> Response:
    """The router's own 404/405, in the same JSON shape as everything else."""
    status = getattr(exc, "status_code", 500)
    words = {404: f"no such endpoint: {request.method} {request.url.path}",
             405: f"method {request.method} is not allowed on {request.url.path}"}
    message = words.get(status, str(getattr(exc, "detail", "")) or "error")
    code = _ROUTER_CODES.get(status)
    return ApiError(status, message, code=code, headers=getattr(exc, "headers", None)).response()


def error_shape(path: str) -> Callable[[ApiError], Response]:
    """How a refusal before any route (the gate's) is rendered: in the calling API's shape."""
    if path in ("/v1/messages", "/v1/messages/count_tokens", "/messages", "/messages/count_tokens"):
        return http_anthropic.error_response
    if path.startswith("/api/"):
        return http_ollama.error_response
    return ApiError.response
