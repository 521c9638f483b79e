"""Routing signals, fast: the readiness table, the capacity arithmetic, and
the front door's side against a real supervisor with no model loaded.

What a router reads: `GET /health?model=ID` (a status a request would get, with
Retry-After), the `readiness` of each `/v1/models` card, `X-Memvisor-Host` on every
response, and a machine-readable `code` in every refusal body, in every API's shape.
The live end (429, a load's 503 with progress, a SIGSTOPped worker) is
live/test_fleet_routing_live.py; a real router in front of several hosts is live/test_fleet_litellm_live.py.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.sizes import GiB, MiB
from supervisor.config import ModelConfig
from supervisor.config_file import ConfigError, parse_config
from supervisor.doors.views import ModelView, WorkerView
from supervisor.guard.readiness import (
    CODES,
    STATUS,
    assess,
    kv_utilization,
    load_progress,
    loading_retry,
    share,
)
from supervisor.policy.admission import FitReport
from tests.frontdoor_harness import fake_huge_model
from tests.http_harness import LiveServer, make_config

pytestmark = pytest.mark.usefixtures("no_front_door_errors")

MODEL = ModelConfig(id="m", path="/x", max_concurrency=2, max_queue=1)


def worker(state: str = "ready", requests: int = 0, *, marked: bool = False) -> WorkerView:
    return WorkerView(worker_id="m#1", model_id="m", pid=1, state=state, running=requests,  # type: ignore[arg-type]
                      leaving=marked)


def ready(h=None, *, view="unloaded", waiting=0, paused=False, silent=None, progress=None, fit=None, retry_in=-1.0):
    return assess(model=MODEL, host="h1", view=ModelView(id="m", state=view, retry_in=retry_in), worker=h,
                  waiting=waiting, paused=paused, silent=silent, progress=progress, fit=fit)


def fit(fits: bool) -> FitReport:
    return FitReport(model="m", fits=fits, estimated_bytes=GiB, weight_bytes=GiB, kv_bytes=0, context_tokens=0,
                     usage=0, ceiling=GiB // 2, binding="static", evict=[], message="model too large: ...",
                     error="model_too_large" if not fits else "")


# ---------------------------------------------------------------------------
# the table: one state per situation, the status a request would get


def test_idle_loaded_model_is_ready_and_accepting():
    r = ready(worker("ready"))
    assert (r.state, r.status, r.accepting, r.loaded, r.code, r.retry_after) == ("ready", 200, True, True, None, None)
    assert (r.running, r.queued, r.worker, r.host) == (0, 0, "m#1", "h1")


def test_every_slot_taken_with_queue_room_is_busy_but_accepting():
    r = ready(worker("busy", requests=2))
    assert (r.state, r.status, r.running, r.queued) == ("busy", 200, 2, 0)


def test_slots_and_queue_full_is_saturated_429_with_retry_after():
    """max_concurrency 2 + max_queue 1: the third in flight fills it; the gate's waiters count."""
    r = ready(worker("busy", requests=2), waiting=1)
    assert (r.state, r.status, r.code, r.retry_after) == ("saturated", 429, "model_at_capacity", 1)
    assert (r.running, r.queued, r.accepting) == (2, 1, False)


def test_paused_admission_refuses_only_when_the_worker_already_runs_something():
    """SPEC P3: an idle worker under pressure still takes one request."""
    assert ready(worker("ready"), paused=True).state == "ready"
    r = ready(worker("busy", requests=1), paused=True)
    assert (r.state, r.status, r.code, r.retry_after) == ("paused", 503, "admission_paused", 2)


def test_a_silent_worker_is_unresponsive_503():
    r = ready(worker("ready"), silent=3.2)
    assert (r.state, r.status, r.code) == ("unresponsive", 503, "worker_unresponsive")
    assert "3.2 s" in r.reason


def test_a_load_in_flight_is_503_with_progress_and_its_retry_after():
    progress = load_progress("loading", began=10.0, now=14.0, grown=50 * MiB, estimate=100 * MiB)
    r = ready(worker("loading"), progress=progress)
    assert (r.state, r.status, r.code, r.loaded) == ("loading", 503, "model_loading", False)
    assert r.progress == progress and progress.eta == 4.0 and r.retry_after == 4


def test_draining_and_failed_are_503():
    assert ready(worker("ready", marked=True)).state == "draining"
    r = ready(view="failed", retry_in=7.2)
    assert (r.state, r.status, r.code, r.retry_after) == ("failed", 503, "model_failed", 8)
    assert ready(view="failed").retry_after is None  # nothing scheduled: no invitation to retry


def test_unloaded_is_accepting_unless_it_would_not_fit():
    assert (ready().state, ready().status, ready().accepting) == ("unloaded", 200, True)
    assert ready(fit=fit(True)).state == "unloaded"
    r = ready(fit=fit(False))
    assert (r.state, r.status, r.code) == ("does_not_fit", 507, "model_too_large")


def test_every_refusing_state_has_a_code_and_every_code_its_state():
    for state, status in STATUS.items():
        assert (status == 200) == (state not in CODES), state


# ---------------------------------------------------------------------------
# the arithmetic behind the gauges and Retry-After


def test_load_progress_tells_an_eta_only_once_a_tenth_is_in():
    assert load_progress("loading", 0.0, 2.0, 5 * MiB, 100 * MiB).eta is None
    assert load_progress("loading", 0.0, 2.0, 25 * MiB, 100 * MiB).eta == 6.0
    assert load_progress("starting", 0.0, 2.0, 0, 100 * MiB).eta is None
    assert load_progress("loading", 0.0, 2.0, 100 * MiB, 0).eta is None  # estimate unknown
    assert loading_retry(None) == 2 and loading_retry(load_progress("loading", 0, 1000, 20, 100)) == 30


def test_kv_utilization_is_one_when_no_room_is_left_below_soft():
    assert kv_utilization(0, 100) == 0.0
    assert kv_utilization(100, 300) == 0.25
    assert kv_utilization(100, 0) == 1.0 and kv_utilization(0, -5) == 1.0
    assert kv_utilization(100, None) == 0.0  # guard off: nothing pauses admission
    assert share(50, 200) == 0.25 and share(50, 0) == 0.0 and share(300, 200) == 1.0


def test_max_queue_and_host_name_are_validated_config():
    assert parse_config('[[models]]\nid = "m"\npath = "/x"\n').models[0].max_queue == 64
    with pytest.raises(ConfigError, match="max_queue"):
        parse_config('[[models]]\nid = "m"\npath = "/x"\nmax_queue = -1\n')
    with pytest.raises(ConfigError, match="host_name"):
        parse_config('[supervisor]\nhost_name = "a b"\n')


# ---------------------------------------------------------------------------
# the front door, a real supervisor, nothing loaded


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rs")
    models = [ModelConfig(id="huge", path=str(fake_huge_model(root / "huge", 1024 * GiB))),
              ModelConfig(id="small", path=str(fake_huge_model(root / "small", 1 * MiB)))]
    with LiveServer(make_config(models, host_name="host-7"), tmp_path_factory.mktemp("rt")) as live:
        yield live


def test_health_of_one_model_answers_what_a_request_would_get(server):
    async def main():
        async with server.client() as c:
            await c.get("/v1/models")  # reads the weights' headers (A2) off the loop
            await asyncio.sleep(0.3)
            server.arbiter.wake()  # a tick, so the readiness has the guard's figures
            await asyncio.sleep(0.3)
            return [await c.get("/health", params={"model": m}) for m in ("huge", "small", "nope")]

    huge, small, nope = server.run(main())
    assert huge.status_code == 507 and huge.json()["state"] == "does_not_fit"
    assert huge.json()["code"] == "model_too_large" and "more than the whole" in huge.json()["reason"]
    assert small.status_code == 200
    assert {k: small.json()[k] for k in ("model", "host", "state", "accepting", "loaded")} == {
        "model": "small", "host": "host-7", "state": "unloaded", "accepting": True, "loaded": False}
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "model_not_found"


def test_model_cards_carry_the_same_readiness(server):
    async def main():
        async with server.client() as c:
            cards = (await c.get("/v1/models")).json()["data"]
            return cards, (await c.get("/health", params={"model": "small"})).json()

    cards, health = server.run(main())
    by_id = {card["id"]: card["readiness"] for card in cards}
    assert by_id["small"] == health and by_id["huge"]["state"] == "does_not_fit"


def test_every_response_names_the_host(server):
    async def main():
        async with server.client() as c:
            return [await c.get("/health"), await c.get("/nowhere"), await c.get("/metrics"),
                    await c.post("/v1/chat/completions", json={"model": "nope", "messages": []}),
                    await c.get("/status", headers={"host": "evil.example"})]

    for r in server.run(main()):
        assert r.headers["x-memvisor-host"] == "host-7", (r.request.url, r.status_code)
        assert "x-memvisor-worker" not in r.headers  # nothing served them


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan", "99999"])
def test_an_unusable_max_wait_header_is_a_400_naming_it(server, value):
    async def main():
        async with server.client() as c:
            return await c.post("/v1/chat/completions", headers={"x-memvisor-max-wait": value},
                                json={"model": "small", "messages": [{"role": "user", "content": "hi"}]})

    r = server.run(main())
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_header" and r.json()["error"]["param"] == "x-memvisor-max-wait"
    assert server.arbiter.pool.counters.spawned == 0


def test_every_refusal_body_has_a_code_in_every_api_shape(server):
    """A router reads `code`, never the words: OpenAI, Anthropic and Ollama shapes alike."""
    chat = {"model": "huge", "messages": [{"role": "user", "content": "hi"}]}
    asks = [
        ("POST", "/v1/chat/completions", chat, {}),  # 507
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": []}, {}),  # 404
        ("POST", "/v1/chat/completions", {"model": "small", "messages": [], "n": 3}, {}),  # 400
        ("GET", "/v1/chat/completions", None, {}),  # 405
        ("GET", "/nowhere", None, {}),  # 404 from the router
        ("POST", "/v1/completions", None, {"content-type": "text/plain"}),  # 415 from the gate
        ("GET", "/status", None, {"host": "evil.example"}),  # 421 from the gate
        ("POST", "/v1/messages", {"model": "huge", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
         {}),  # 507, Anthropic's shape
        ("POST", "/api/chat", {"model": "nope", "messages": []}, {}),  # 404, Ollama's shape
    ]

    async def main():
        async with server.client() as c:
            return [await c.request(m, path, json=body, headers=h) if body is not None
                    else await c.request(m, path, headers=h, content=b"x" if m == "POST" else None)
                    for m, path, body, h in asks]

    for (_m, path, _b, _h), r in zip(asks, server.run(main())):
        assert r.status_code >= 400, path
        body = r.json()
        error = body["error"]
        code = error if isinstance(error, str) else error.get("code")
        if isinstance(error, str):  # Ollama: {"error": "words", "code": ...}
            code = body.get("code")
        assert isinstance(code, str) and code, (path, r.status_code, body)
