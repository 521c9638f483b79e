"""The front door's edges against a real supervisor and a real HTTP server.

No model is ever loaded here (no MLX process is spawned), so these run with
the fast suite: bad input of every kind, the admin checks, the guard's
runtime settings (SPEC T6), status, metrics, and a load refused before any
process starts (SPEC A3). Each answer must be OpenAI-style error JSON, never
a traceback, and the server must keep serving afterwards.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.sizes import GiB
from supervisor.config import ModelConfig
from tests.frontdoor_harness import assert_openai_error, fake_huge_model
from tests.http_harness import ADMIN_TOKEN, LiveServer, make_config, metric, non_loopback_address

pytestmark = pytest.mark.usefixtures("no_front_door_errors")

MAX_BODY = 64 * 1024
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fd")
    models = [ModelConfig(id="huge", path=str(fake_huge_model(root / "huge", 1024 * GiB))),
              ModelConfig(id="org/never-loaded", path=str(root / "missing"))]
    with LiveServer(make_config(models, max_body=MAX_BODY, body_timeout=1.0), tmp_path_factory.mktemp("rt")) as live:
        yield live


def response_head(server, request: bytes) -> bytes:
    """Send `request` (raw HTTP) and nothing more; the status line and headers that come back."""

    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        return head

    return server.run(main())


def test_unknown_model_is_404_on_every_door(server):
    async def main():
        async with server.client() as c:
            chat = await c.post("/v1/chat/completions", json={"model": "nope", "messages": [
                {"role": "user", "content": "hi"}]})
            text = await c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
            load = await c.post("/v1/models/nope/load")
            one = await c.get("/v1/models/nope")
        for r in (chat, text, load, one):
            assert "'nope' does not exist" in assert_openai_error(r, 404, "model_not_found")["message"]
        # and the OpenAI client reads it as NotFound
        import openai

        with pytest.raises(openai.NotFoundError):
            await server.openai().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    server.run(main())


def test_malformed_json_and_wrong_types_are_400_naming_the_field(server):
    async def main():
        async with server.client() as c:
            bad_json = await c.post("/v1/chat/completions", content=b'{"model": "huge", "messages": [', headers=JSON)
            wrong = await c.post("/v1/chat/completions", json={"model": "huge", "messages": [
                {"role": "user", "content": "x"}], "max_tokens": "lots"})
            no_messages = await c.post("/v1/chat/completions", json={"model": "huge", "messages": []})
            still = await c.get("/v1/models")
        assert "not valid JSON" in assert_openai_error(bad_json, 400)["message"]
        error = assert_openai_error(wrong, 400)
        assert error["param"] == "max_tokens" and "Expected `int | null`, got `str`" in error["message"]
        assert assert_openai_error(no_messages, 400)["param"] == "messages"
        assert still.status_code == 200  # the server keeps serving everyone else

    server.run(main())


def test_oversized_bodies_are_413_whether_declared_or_chunked(server):
    async def chunks():
        for _ in range(8):
            yield b"x" * (MAX_BODY // 4)

    async def main():
        async with server.client() as c:
            # /v1/completions takes no images, so max_body bounds what it reads (docs/vision.md: chat's body
            # may pass it by its images alone; test_api_images.py pins that side)
            declared = await c.post("/v1/completions", content=b"{" + b" " * (MAX_BODY + 10) + b"}", headers=JSON)
            chunked = await c.post("/v1/completions", content=chunks(), headers=JSON)
            after = await c.get("/health")
        assert "exceeds the limit of 64 KiB" in assert_openai_error(declared, 413, "request_too_large")["message"]
        assert_openai_error(chunked, 413, "request_too_large")
        assert after.status_code == 200

    server.run(main())


def test_a_1gb_content_length_is_refused_before_any_body_is_sent(server):
    """The guard's own front door must not buffer a huge upload: the 413 comes back
    while the client has sent nothing but headers."""
    head = response_head(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head


def test_wrong_method_and_unknown_path_are_json_too(server):
    async def main():
        async with server.client() as c:
            return (await c.get("/v1/chat/completions"), await c.delete("/v1/models"),
                    await c.get("/v1/models/huge/load"), await c.get("/v2/things"))

    get_chat, delete_models, get_load, unknown = server.run(main())
    assert_openai_error(get_chat, 405, "method_not_allowed")
    assert_openai_error(delete_models, 405, "method_not_allowed")
    assert_openai_error(get_load, 405, "method_not_allowed")
    assert_openai_error(unknown, 404, "unknown_endpoint")


def test_a3_model_larger_than_the_ceiling_is_507_naming_binding_and_remedy(server):
    """oMLX refusals read like crashes; ours say which constraint binds and what to do,
    and nothing is spawned for a model that cannot fit."""

    async def main():
        async with server.client() as c:
            r = await c.post("/v1/chat/completions", json={"model": "huge", "messages": [
                {"role": "user", "content": "hi"}]})
            metrics = (await c.get("/metrics")).text
            models = (await c.get("/v1/models")).json()["data"]
        return r, metrics, models

    r, metrics, models = server.run(main())
    error = assert_openai_error(r, 507, "model_too_large")
    assert error["type"] == "insufficient_memory_error"
    binding = server.arbiter.enforcer.last.ceilings.binding
    assert binding and binding in error["message"]
    assert "choose a lower tier" in error["message"] or "close other apps" in error["message"]
    assert server.arbiter.pool.counters.spawned == 0
    assert metric(metrics, "memvisor_guard_events_total", kind="refused") >= 1
    assert {m["id"]: m["state"] for m in models}["huge"] == "unloaded"


def test_s1_status_carries_the_guard_and_the_pub_endpoint(server):
    async def main():
        async with server.client() as c:
            return (await c.get("/status")).json()

    status = server.run(main())
    guard = status["guard"]
    for key in ("enabled", "tier", "ceiling", "static", "dynamic", "gpu_cap", "reserve", "soft_bytes",
                "hard_bytes", "usage", "pressure_level", "utilization", "poll_interval", "workers"):
        assert key in guard, key
    assert status["pub"] == server.arbiter.endpoints.pub and status["pub"].startswith("ipc://")
    assert status["http"].endswith(f":{server.port}")
    assert [m["id"] for m in status["models"]] == ["huge", "org/never-loaded"]


def test_metrics_expose_ceiling_components_usage_and_level(server):
    async def main():
        async with server.client() as c:
            await c.get("/health")
            return (await c.get("/metrics")).text

    text = server.run(main())
    last = server.arbiter.enforcer.last
    assert metric(text, "memvisor_ceiling_bytes") > 0
    assert metric(text, "memvisor_ceiling_component_bytes", component="static") == last.ceilings.static
    assert metric(text, "memvisor_ceiling_binding", component=last.ceilings.binding) == 1
    assert metric(text, "memvisor_usage_bytes") > 0
    assert metric(text, "memvisor_pressure_level") == {"ok": 0, "soft": 1, "hard": 2}[last.level]
    assert metric(text, "memvisor_queue_depth") == 0
    assert metric(text, "memvisor_http_requests_total", endpoint="/health", status="200") >= 1
    assert metric(text, "memvisor_request_duration_seconds_count", endpoint="/health") >= 1


def test_t6_admin_guard_changes_tier_and_ceiling_at_runtime(server):
    async def main():
        async with server.client() as c:
            changed = await c.post("/admin/guard", json={"tier": "custom", "custom_ceiling": "12GiB"})
            status = (await c.get("/status")).json()["guard"]
            bad_size = await c.post("/admin/guard", json={"custom_ceiling": "12 parsecs"})
            bad_tier = await c.post("/admin/guard", json={"tier": "reckless"})
            typo = await c.post("/admin/guard", json={"teir": "safe"})
            back = await c.post("/admin/guard", json={"tier": "balanced", "custom_ceiling": 0})
        return changed, status, bad_size, bad_tier, typo, back

    changed, status, bad_size, bad_tier, typo, back = server.run(main())
    assert changed.status_code == 200 and changed.json()["guard"]["tier"] == "custom"
    assert status["tier"] == "custom" and status["custom_ceiling"] == 12 * GiB
    assert status["dynamic"] == 12 * GiB  # C3: the custom ceiling is the dynamic candidate
    assert assert_openai_error(bad_size, 400)["param"] == "custom_ceiling"
    assert "unknown tier 'reckless'" in assert_openai_error(bad_tier, 400)["message"]
    assert assert_openai_error(typo, 400)["param"] == "teir"
    assert back.json()["guard"]["tier"] == "balanced"


def test_d6_t6_admin_guard_changes_the_custom_device_ceiling_at_runtime(server):
    async def main():
        async with server.client() as c:
            changed = await c.post("/admin/guard", json={"custom_device_ceiling": "60GiB"})
            bad_size = await c.post("/admin/guard", json={"custom_device_ceiling": "60 parsecs"})
            slip = await c.post("/admin/guard", json={"custom_device_ceiling": 60})
            back = await c.post("/admin/guard", json={"custom_device_ceiling": 0})
        return changed, bad_size, slip, back

    changed, bad_size, slip, back = server.run(main())
    assert changed.status_code == 200 and changed.json()["guard"]["custom_device_ceiling"] == 60 * GiB
    assert changed.json()["guard"]["device"] is None  # no discrete device here: no device pool shown
    assert assert_openai_error(bad_size, 400)["param"] == "custom_device_ceiling"
    assert "at least 1MiB" in assert_openai_error(slip, 400, "invalid_guard_settings")["message"]
    assert back.json()["guard"]["custom_device_ceiling"] == 0


def test_admin_without_token_refuses_non_loopback_clients(server):
    """No token configured: anyone who can reach the port must not retune the guard."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")

    async def main():
        async with server.client(host=address) as c:
            guard = await c.post("/admin/guard", json={"enabled": False})
            load = await c.post("/v1/models/huge/load")
            unload = await c.post("/v1/models/huge/unload")
            models = await c.get("/v1/models")
        return guard, load, unload, models

    guard, load, unload, models = server.run(main())
    for r in (guard, load, unload):
        assert "only loopback clients" in assert_openai_error(r, 403, "forbidden")["message"]
    assert models.status_code == 200  # inference endpoints stay open
    assert server.arbiter.enforcer.settings.enabled is True


def test_admin_token_is_required_when_configured_from_anywhere(token_server):
    address = non_loopback_address()

    async def main():
        async with token_server.client() as c:
            missing = await c.post("/admin/guard", json={"tier": "safe"})
            wrong = await c.post("/admin/guard", json={"tier": "safe"}, headers={"Authorization": "Bearer nope"})
            right = await c.post("/admin/guard", json={"tier": "safe"},
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        remote = None
        if address is not None:
            async with token_server.client(host=address) as c:
                remote = await c.post("/admin/guard", json={"tier": "aggressive"},
                                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        return missing, wrong, right, remote

    missing, wrong, right, remote = token_server.run(main())
    assert_openai_error(missing, 401, "invalid_api_key")
    assert missing.headers["www-authenticate"] == "Bearer"
    assert_openai_error(wrong, 401, "invalid_api_key")
    assert right.status_code == 200 and right.json()["guard"]["tier"] == "safe"
    if remote is not None:  # with a token, a remote admin is allowed
        assert remote.status_code == 200 and remote.json()["guard"]["tier"] == "aggressive"


def test_health_is_ok_with_no_pinned_models(server):
    async def main():
        async with server.client() as c:
            return await c.get("/health")

    r = server.run(main())
    assert r.status_code == 200 and r.json() == {"status": "ok", "waiting": {}}


def test_model_list_and_ids_with_slashes(server):
    """Hub-style ids (`org/name`) are one path parameter, and the SDK reads the list."""

    async def main():
        listed = await server.openai().models.list()
        async with server.client() as c:
            return [m.id for m in listed.data], await c.get("/v1/models/org/never-loaded")

    ids, one = server.run(main())
    assert ids == ["huge", "org/never-loaded"]
    assert one.status_code == 200
    card = one.json()
    details = card.pop("memvisor")
    readiness = card.pop("readiness")  # what a request would meet (tested in test_routing_signals)
    assert readiness["model"] == "org/never-loaded" and readiness["loaded"] is False
    assert card | {"created": 0} == {"id": "org/never-loaded", "object": "model", "owned_by": "memvisor",
                                     "created": 0, "state": "unloaded", "pinned": False, "worker": None,
                                     "pid": None, "context_length": None,  # not known for this model
                                     "capabilities": ["completion"]}  # nothing says it embeds
    assert details["id"] == "org/never-loaded" and details["state"] == "unloaded" and details["usage"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/admin/guard"])
def test_deeply_nested_json_is_400_not_a_500(server, path):
    """Nesting 3,000 deep raised RecursionError inside the decoder (a 500)."""
    nested = b'{"model": "huge", "extra": ' + b"[" * 3000 + b"]" * 3000 + b"}"

    async def main():
        async with server.client() as c:
            return await c.post(path, content=nested, headers=JSON), await c.get("/health")

    refused, after = server.run(main())
    assert "deeper than 64 levels" in assert_openai_error(refused, 400)["message"]
    assert after.status_code == 200


def test_a_body_shorter_than_its_content_length_is_408_within_the_deadline(server):
    """It held its connection until the client gave up; now body_timeout (1 s here) ends it."""
    head = response_head(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
    assert head.startswith(b"HTTP/1.1 408"), head


def test_ollama_a3_refusal_keeps_507_and_its_words_in_ollama_shape(server):
    """A memory refusal through /api/chat is the same 507 naming what binds,
    as Ollama's `{"error": ...}` (the official client raises it with the status); the
    gate's refusals on /api/* come in that shape too."""
    import ollama

    async def main():
        try:
            await ollama.AsyncClient(host=server.url()).chat(model="huge", messages=[{"role": "user", "content": "hi"}])
        except ollama.ResponseError as exc:
            refused = exc
        async with server.client() as c:
            plain = await c.post("/api/chat", content=b'{"model": "huge"}',  # a page's (curl's is taken)
                                 headers={"content-type": "text/plain", "Origin": "http://localhost:3000"})
            forever = await c.post("/api/generate", json={"model": "huge", "prompt": "hi", "keep_alive": "inf"})
        return refused, plain, forever

    refused, plain, forever = server.run(main())
    binding = server.arbiter.enforcer.last.ceilings.binding
    assert refused.status_code == 507 and binding and binding in refused.error
    assert plain.status_code == 415 and isinstance(plain.json()["error"], str)
    assert forever.status_code == 400 and forever.json()["param"] == "keep_alive"
    assert server.arbiter.pool.counters.spawned == 0
