"""Who may unload what, through every door, and what /health says after (docs/access.md).

A real supervisor with API keys and an admin token, a pinned model "a" and an unpinned
"b", real workers, the official `ollama` client. An ordinary API key unloaded the
pinned model through Ollama's `keep_alive: 0` with no prompt, which the admin route
refused the same key (401); after it, and after an admin's unload of the pinned model,
/health answered 503 `loading` for good while nothing loaded, and a router dropped the
host. Now every unload is `Supervisor.unload` with its one rule (service.py
`unload_refusal`): a pinned model is an admin's to unload; a key's `keep_alive: 0` is
the idle timer a chat's gives (P10), never a drain; /health lists a pinned model an
admin unloaded under `unloaded`, at 200.
"""

from __future__ import annotations

import asyncio

import httpx
import ollama
import pytest

from supervisor.config import ModelConfig
from tests.http_harness import ADMIN_TOKEN, LiveServer, make_config, until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

KEY = "k-plain"
AS_KEY = {"Authorization": f"Bearer {KEY}"}
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    models = [ModelConfig(id="a", path=str(tiny_models.a), pinned=True), ModelConfig(id="b", path=str(tiny_models.b))]
    config = make_config(models, http="127.0.0.1:0", api_keys=[KEY], admin_token=ADMIN_TOKEN)
    with LiveServer(config, tmp_path_factory.mktemp("rt")) as live:
        live.run(until(lambda: serving(live, "a"), 60, "the pinned model"))
        yield live


def serving(live: LiveServer, model: str) -> bool:
    handle = live.arbiter.pool.worker_for(model)
    return handle is not None and handle.serving


def pid(live: LiveServer, model: str) -> int | None:
    handle = live.arbiter.pool.worker_for(model)
    return handle.pid if handle is not None else None


async def refused(call) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as caught:
        await call
    return caught.value


def test_a_plain_key_cannot_unload_a_pinned_model_through_ollamas_keep_alive_0(server):
    """The empty generate and chat with keep_alive 0 are refused with a 403 the ollama client raises
    (naming the rule); with a prompt the reply is Ollama's usual one; the admin route refuses
    the same key; the pinned model's worker is the same process after all of it."""
    before = pid(server, "a")

    async def main():
        key = ollama.AsyncClient(host=server.url(), headers=AS_KEY)
        empty_generate = await refused(key.generate(model="a", keep_alive=0))
        empty_chat = await refused(key.chat(model="a", messages=[], keep_alive=0))
        prompted = await key.generate(model="a", prompt="Hi", keep_alive=0, options={"num_predict": 3})
        async with server.client() as c:
            admin_route = await c.post("/v1/models/a/unload", headers=AS_KEY)
        await asyncio.sleep(1.5)  # P10 ticks at least once: a pinned model's timer never runs out
        return empty_generate, empty_chat, prompted, admin_route

    empty_generate, empty_chat, prompted, admin_route = server.run(main())
    for error in (empty_generate, empty_chat):
        assert error.status_code == 403 and "pinned" in error.error and "admin" in error.error
    assert prompted.done and prompted.done_reason == "length"
    assert admin_route.status_code == 401
    assert serving(server, "a") and pid(server, "a") == before
    assert server.arbiter.service.counters()["unload_refused"] >= 2


def test_an_admins_unload_of_a_pinned_model_is_said_by_health_as_unloaded_not_loading(server):
    """Through Ollama's empty keep_alive 0 and through the admin route: /health stays 200 and
    lists the model under `unloaded`; a request loads it again and the entry goes."""

    async def main():
        admin = ollama.AsyncClient(host=server.url(), headers=AS_ADMIN)
        gone = await admin.generate(model="a", keep_alive=0)
        async with server.client() as c:
            after_ollama = await c.get("/health")
            back = await admin.chat(model="a", messages=HI, options={"num_predict": 2})
            reloaded = await c.get("/health")
            route = await c.post("/v1/models/a/unload", headers=AS_ADMIN)
            after_route = await c.get("/health")
            model_health = await c.get("/health", params={"model": "a"})
            await admin.chat(model="a", messages=HI, options={"num_predict": 2})  # as the module found it
        return gone, after_ollama, back, reloaded, route, after_route, model_health

    gone, after_ollama, back, reloaded, route, after_route, model_health = server.run(main())
    assert gone.done_reason == "unload"
    for health in (after_ollama, after_route):
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["status"] == "ok" and body["waiting"] == {} and "unloaded on purpose" in body["unloaded"]["a"]
    assert back.done and reloaded.status_code == 200 and "unloaded" not in reloaded.json()
    assert route.status_code == 200 and route.json()["unloaded"] is True
    assert model_health.status_code == 200 and model_health.json()["state"] == "unloaded"
    assert serving(server, "a")


def test_a_plain_keys_keep_alive_0_lets_an_unpinned_model_go_once_idle(server):
    """What a chat's keep_alive 0 does, the empty request does too for a key: the idle timer
    runs out (P10) and the model leaves; the key never drains a worker itself."""

    async def main():
        key = ollama.AsyncClient(host=server.url(), headers=AS_KEY)
        await key.chat(model="b", messages=HI, options={"num_predict": 2})
        loaded = serving(server, "b")
        reply = await key.generate(model="b", keep_alive=0)
        await until(lambda: pid(server, "b") is None, 30, "b to leave once idle")
        return loaded, reply

    loaded, reply = server.run(main())
    assert loaded and reply.done_reason == "unload"


def test_the_control_socket_is_an_admin_and_unloads_a_pinned_model(server):
    """The CLI's door (`unload a`) is the operator's: the same rule lets it through."""
    from shared import protocol as p
    from supervisor.wiring.control_answers import handle_control

    async def main():
        answer = await handle_control(server.arbiter.service, p.UnloadRequest(model="a"))
        async with httpx.AsyncClient(base_url=server.url()) as c:
            health = await c.get("/health")
        await server.arbiter.service.load("a")  # as the module found it
        return answer, health

    answer, health = server.run(main())
    assert isinstance(answer, p.ControlOk) and "unloaded" in answer.detail
    assert health.status_code == 200 and "a" in health.json()["unloaded"]
