"""The browser is a client, not an admin (supervisor/http/browser_guard.py, require_admin).

Each attack a web page could make on a loopback supervisor, as real HTTP
against a real supervisor (no model is loaded): a cross-origin `text/plain`
POST that turned the guard off, a DNS-rebinding Host header that read /status
and changed the tier, a form post to unload; and what a browser client that
should be allowed (a local web UI on another port) needs: correct CORS
preflights and headers. The headers are the ones a browser sends; what the
browser itself does with the answers is the CORS spec's part.
"""

from __future__ import annotations

import pytest

from shared.sizes import GiB
from supervisor.config import ModelConfig
from supervisor.config_file import ConfigError, load_config
from tests.frontdoor_harness import assert_openai_error, fake_huge_model
from tests.http_harness import ADMIN_TOKEN, LiveServer, make_config

pytestmark = pytest.mark.usefixtures("no_front_door_errors")

EVIL = "http://evil.example"
LOCAL_UI = "http://localhost:3000"  # a local web UI: allowed by the default cors_origins
CHAT = {"model": "huge", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    models = [ModelConfig(id="huge", path=str(fake_huge_model(root / "huge", 1024 * GiB)))]
    with LiveServer(make_config(models, http="127.0.0.1:0"), tmp_path_factory.mktemp("rt")) as live:
        yield live


def guard_enabled(server) -> bool:
    return server.arbiter.enforcer.settings.enabled


def test_a_cross_origin_text_plain_post_cannot_turn_the_guard_off(server):
    """The attack: a page's `fetch(..., {mode: "no-cors", body: '{"enabled": false}'})` is a
    "simple request" (text/plain, no preflight): it reached /admin/guard and was obeyed."""

    async def main():
        async with server.client() as c:
            foreign = await c.post("/admin/guard", content=b'{"enabled": false}',
                                   headers={"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"})
            local_page = await c.post("/admin/guard", content=b'{"enabled": false}',
                                      headers={"Origin": LOCAL_UI, "Content-Type": "text/plain"})
            no_origin = await c.post("/admin/guard", content=b'{"enabled": false}',
                                     headers={"Content-Type": "text/plain"})
            form = await c.post("/v1/models/huge/unload", content=b"x=1", headers={
                "Origin": EVIL, "Content-Type": "application/x-www-form-urlencoded"})
        return foreign, local_page, no_origin, form

    foreign, local_page, no_origin, form = server.run(main())
    assert "evil.example" in assert_openai_error(foreign, 403, "origin_not_allowed")["message"]
    assert "application/json" in assert_openai_error(local_page, 415, "unsupported_media_type")["message"]
    assert_openai_error(no_origin, 415, "unsupported_media_type")
    assert_openai_error(form, 403, "origin_not_allowed")
    assert guard_enabled(server) is True


def test_a_page_needs_the_admin_token_even_from_loopback(server):
    """No token configured: a page from an allowed origin (a local UI) may call /v1 but not
    administer; curl (no Origin) and the dashboard (this server's own origin) still may."""

    async def main():
        async with server.client() as c:
            page = await c.post("/admin/guard", json={"enabled": False}, headers={"Origin": LOCAL_UI})
            unload = await c.post("/v1/models/huge/unload", headers={"Origin": LOCAL_UI,
                                                                     "Content-Type": "application/json"})
            dashboard = await c.post("/admin/guard", json={"tier": "safe"}, headers={"Origin": server.url()})
            curl = await c.post("/admin/guard", json={"tier": "balanced"})
            bodyless = await c.post("/v1/models/huge/unload")  # curl -X POST .../unload: no body, no Origin
        return page, unload, dashboard, curl, bodyless

    page, unload, dashboard, curl, bodyless = server.run(main())
    assert "may not administer" in assert_openai_error(page, 403, "forbidden")["message"]
    assert_openai_error(unload, 403, "forbidden")
    assert guard_enabled(server) is True
    assert dashboard.status_code == 200 and dashboard.json()["guard"]["tier"] == "safe"
    assert curl.status_code == 200 and curl.json()["guard"]["tier"] == "balanced"
    assert bodyless.status_code == 200 and bodyless.json()["unloaded"] is False


def test_a_page_on_another_local_port_cannot_administer_without_the_token(server):
    """"Same origin" is scheme, host AND port: a page served on another loopback port (any local
    dev server, any local app) is not this server's dashboard. A check that ignored the port let
    such pages load, unload and retune the guard without a token, and was caught only because a
    CORS header vanished; here the refusal itself is asserted, with the dashboard's own origin
    (same host, this port) as the control."""
    other = f"http://127.0.0.1:{server.port + 1 if server.port < 65535 else server.port - 1}"
    before = server.arbiter.enforcer.settings.tier

    async def main():
        async with server.client() as c:
            page = {"Origin": other}
            refused = [await c.post("/v1/models/huge/load", headers={**page, "Content-Type": "application/json"}),
                       await c.post("/v1/models/huge/unload", headers={**page, "Content-Type": "application/json"}),
                       await c.post("/admin/guard", json={"tier": "aggressive"}, headers=page),
                       await c.post("/admin/guard", json={"tier": "aggressive"},
                                    headers={"Origin": other.replace("127.0.0.1", "localhost")})]
            own = await c.post("/admin/guard", json={"tier": before}, headers={"Origin": server.url()})
        return refused, own

    refused, own = server.run(main())
    for r in refused:
        assert "may not administer" in assert_openai_error(r, 403, "forbidden")["message"]
    assert server.arbiter.enforcer.settings.tier == before
    assert own.status_code == 200  # the dashboard: this very origin


def test_a_page_with_the_admin_token_may_administer(token_server):
    async def main():
        async with token_server.client() as c:
            return await c.post("/admin/guard", json={"tier": "safe"}, headers={
                "Origin": LOCAL_UI, "Authorization": f"Bearer {ADMIN_TOKEN}"})

    r = token_server.run(main())
    assert r.status_code == 200 and r.json()["guard"]["tier"] == "safe"


def test_a_rebinding_host_header_is_refused_on_every_route(server):
    """DNS rebinding: evil.example resolves to 127.0.0.1, so the page's requests reach this
    port with `Host: evil.example:PORT`: it read /status and changed the tier."""
    host = f"evil.example:{server.port}"

    async def main():
        async with server.client() as c:
            status = await c.get("/status", headers={"Host": host})
            guard = await c.post("/admin/guard", json={"tier": "aggressive"}, headers={"Host": host})
            messages = await c.post("/v1/messages", json={"model": "huge", "max_tokens": 4, "messages": []},
                                    headers={"Host": host})
            page = await c.get("/", headers={"Host": host})
            fine = [await c.get("/health", headers={"Host": h})
                    for h in ("localhost", f"localhost:{server.port}", "app.localhost:1", "127.0.0.1",
                              f"[::1]:{server.port}")]
        return status, guard, messages, page, fine

    status, guard, messages, page, fine = server.run(main())
    assert "evil.example" in assert_openai_error(status, 421, "misdirected_request")["message"]
    assert_openai_error(guard, 421, "misdirected_request")
    assert_openai_error(page, 421)
    assert messages.status_code == 421 and messages.json()["type"] == "error"  # Anthropic's own shape
    assert messages.json()["error"]["type"] == "permission_error"
    assert [r.status_code for r in fine] == [200] * 5
    assert server.arbiter.enforcer.settings.tier != "aggressive"


def test_generation_posts_need_json(server):
    """A page's text/plain POST to a generation endpoint skips the preflight: 415, in each API's shape."""

    async def main():
        async with server.client() as c:
            plain = {"Content-Type": "text/plain"}
            return [await c.post(path, content=b"{}", headers=plain)
                    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")]

    chat, completions, messages, responses = server.run(main())
    for r in (chat, completions, responses):
        assert_openai_error(r, 415, "unsupported_media_type")
    assert messages.status_code == 415 and messages.json()["type"] == "error"


CURL_FORM = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d '{...}'` declares


def test_ollama_routes_take_curl_d_json_without_an_origin_and_pages_still_need_json(server):
    """Ollama's docs call `curl http://localhost:11434/api/chat -d '{...}'`, which declares a form;
    Ollama reads the JSON, memvisor answered 415. Without an Origin (curl, scripts) the read and
    generation routes now take it; a page (which always sends Origin on a POST) still needs an
    allowed origin and JSON, and Ollama's admin route /api/pull keeps the rule for everyone."""
    show = b'{"model": "huge"}'
    chat = b'{"model": "huge", "messages": [{"role": "user", "content": "hi"}], "stream": false}'

    async def main():
        async with server.client() as c:
            curl = {path: await c.post(path, content=body, headers=CURL_FORM) for path, body in (
                ("/api/show", show), ("/api/chat", chat), ("/api/generate", b'{"model": "huge", "prompt": "hi"}'),
                ("/api/embed", b'{"model": "huge", "input": "hi"}'),
                ("/api/embeddings", b'{"model": "huge", "prompt": "hi"}'))}
            bare = await c.post("/api/show", content=show, headers={"Content-Type": ""})
            not_json = await c.post("/api/show", content=b"model=huge", headers=CURL_FORM)
            evil = await c.post("/api/chat", content=chat, headers={**CURL_FORM, "Origin": EVIL})
            local_page = await c.post("/api/chat", content=chat, headers={**CURL_FORM, "Origin": LOCAL_UI})
            pull = await c.post("/api/pull", content=b'{"model": "org/name"}', headers=CURL_FORM)
            openai = await c.post("/v1/chat/completions", content=chat, headers=CURL_FORM)
        return curl, bare, not_json, evil, local_page, pull, openai

    curl, bare, not_json, evil, local_page, pull, openai = server.run(main())
    assert curl["/api/show"].status_code == 200 and curl["/api/show"].json()["details"]["format"] == "safetensors"
    for path in ("/api/chat", "/api/generate"):  # past the gate: admission refuses the 1 TiB model
        assert curl[path].status_code == 507, (path, curl[path].text)
    for path in ("/api/embed", "/api/embeddings"):  # past the gate: the route says it is no embedding model
        assert curl[path].status_code == 400 and "not an embedding model" in curl[path].json()["error"]
    assert bare.status_code == 200
    assert not_json.status_code == 400 and "error" in not_json.json()
    assert evil.status_code == 403 and "evil.example" in evil.json()["error"]
    assert local_page.status_code == 415 and "application/json" in local_page.json()["error"]
    assert pull.status_code == 415
    assert_openai_error(openai, 415, "unsupported_media_type")


def test_cors_preflight_from_an_allowed_origin_is_204(server):
    """A local web UI (http://localhost:3000) got a 405 on its preflight; now 204 with the headers
    the OpenAI and Anthropic browser SDKs send."""

    async def main():
        async with server.client() as c:
            ask = {"Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
            ok = await c.options("/v1/chat/completions", headers={"Origin": LOCAL_UI, **ask})
            v6 = await c.options("/v1/messages", headers={"Origin": "http://[::1]:8080", **ask})
            evil = await c.options("/v1/chat/completions", headers={"Origin": EVIL, **ask})
            admin = await c.options("/admin/guard", headers={"Origin": LOCAL_UI, **ask})
        return ok, v6, evil, admin

    ok, v6, evil, admin = server.run(main())
    assert ok.status_code == 204, ok.text
    assert ok.headers["access-control-allow-origin"] == LOCAL_UI
    assert "POST" in ok.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in ok.headers["access-control-allow-headers"].split(",")}
    assert allowed >= {"authorization", "content-type", "x-api-key", "anthropic-version", "x-stainless-os"}
    assert "Origin" in ok.headers["vary"]
    assert v6.status_code == 204 and v6.headers["access-control-allow-origin"] == "http://[::1]:8080"
    for refused in (evil, admin):
        assert refused.status_code == 403
        assert not any(h.startswith("access-control-") for h in refused.headers)


def test_cors_headers_only_for_allowed_origins(server):
    async def main():
        async with server.client() as c:
            return (await c.get("/v1/models", headers={"Origin": "http://127.0.0.1:5173"}),
                    await c.get("/v1/models", headers={"Origin": EVIL}),
                    await c.get("/v1/models", headers={"Origin": "http://localhost.evil.example"}),
                    await c.post("/v1/chat/completions", json=CHAT, headers={"Origin": EVIL}))

    local, evil, lookalike, evil_post = server.run(main())
    assert local.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"
    assert "Origin" in local.headers["vary"]
    for r in (evil, lookalike):
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert_openai_error(evil_post, 403, "origin_not_allowed")


UNPREFIXED = ("/models", "/chat/completions", "/completions", "/messages", "/messages/count_tokens", "/tokenize",
              "/detokenize", "/infill")


def test_routes_without_v1_get_the_same_cors_and_no_more(server):
    """Clients that leave out /v1 (and llama.cpp's /tokenize, /detokenize, /infill): a local UI's
    preflight is answered and its responses readable, as on /v1; a foreign page's preflight
    and POST are refused, its reads carry no CORS header, a text/plain POST is a 415."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}

    async def main():
        async with server.client() as c:
            ok = [await c.options(path, headers={"Origin": LOCAL_UI, **ask}) for path in UNPREFIXED]
            evil = [await c.options(path, headers={"Origin": EVIL, **ask}) for path in UNPREFIXED]
            read = await c.get("/models", headers={"Origin": LOCAL_UI})
            refused = await c.post("/chat/completions", json=CHAT, headers={"Origin": LOCAL_UI})
            evil_read = await c.get("/models", headers={"Origin": EVIL})
            evil_post = [await c.post(path, json=CHAT, headers={"Origin": EVIL}) for path in UNPREFIXED[1:]]
            plain = await c.post("/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"})
        return ok, evil, read, refused, evil_read, evil_post, plain

    ok, evil, read, refused, evil_read, evil_post, plain = server.run(main())
    for r in ok:
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == LOCAL_UI
    for r in evil:
        assert r.status_code == 403 and not any(h.startswith("access-control-") for h in r.headers)
    assert read.status_code == 200 and read.headers["access-control-allow-origin"] == LOCAL_UI
    assert refused.status_code == 507 and refused.headers["access-control-allow-origin"] == LOCAL_UI
    assert evil_read.status_code == 200 and "access-control-allow-origin" not in evil_read.headers
    for r in evil_post:
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert_openai_error(plain, 415, "unsupported_media_type")


def test_cors_origins_config(tmp_path):
    from supervisor.http.browser_guard import OriginAllowlist

    path = tmp_path / "m.toml"
    path.write_text('[supervisor]\ncors_origins = ["https://app.example.com", "http://*.lan:*"]\n')
    rule = OriginAllowlist(load_config(path).supervisor.cors_origins)
    assert rule.allowed("https://app.example.com") and rule.allowed("http://box.lan:8080")
    assert not rule.allowed("http://localhost:3000") and not rule.allowed("https://app.example.com.evil")
    for bad in ('"http://a/path"', '"localhost"', '"http://a:port"'):
        path.write_text(f"[supervisor]\ncors_origins = [{bad}]\n")
        with pytest.raises(ConfigError, match="cors_origins"):
            load_config(path)


def test_host_names_that_are_this_server():
    from supervisor.http.browser_guard import HostCheck

    loopback, everywhere, named = HostCheck("127.0.0.1"), HostCheck("0.0.0.0"), HostCheck("box.lan")
    assert loopback.allowed("localhost:1") and loopback.allowed("[::1]") and loopback.allowed("127.0.0.1:8000")
    assert not loopback.allowed("evil.example") and not loopback.allowed("192.168.1.5:8000")
    assert not loopback.allowed("localhost.evil.example") and not loopback.allowed("a b")
    assert everywhere.allowed("192.168.1.5:8000") and not everywhere.allowed("evil.example:8000")
    assert named.allowed("BOX.lan:8000") and not named.allowed("evil.example")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    with LiveServer(make_config([], http="127.0.0.1:0", api_keys=["k-123"]), tmp_path_factory.mktemp("rt")) as live:
        yield live


def test_the_dashboard_puts_no_secret_in_a_url():
    """The page put the admin token (or an API key) in its EventSource URL: in the history, in logs."""
    from supervisor.http.dashboard import read_static

    script = read_static("dashboard.js").decode()
    assert "api_key=" not in script and "location.search" not in script
    assert 'new EventSource("/v1/events?since=" + since.toFixed(3))' in script
    assert '"/ui/ticket"' in script and "Authorization" in script


def test_a_ticket_cookie_opens_the_event_stream_for_the_dashboard(keyed_server):
    """EventSource sends no headers: the key goes once, as a header, to POST /ui/ticket, and
    an HttpOnly SameSite=Strict cookie scoped to /v1/events opens the stream."""

    async def first_line(c, **kw):
        async with c.stream("GET", "/v1/events", params={"topic": "ceiling"}, **kw) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, ""
            async for line in r.aiter_lines():
                return r.status_code, line
        return 0, ""

    async def main():
        async with keyed_server.client() as c:
            page = {"Origin": keyed_server.url(), "Content-Type": "application/json"}
            session = (await c.get("/ui/session")).json()
            without = await first_line(c)
            refused = await c.post("/ui/ticket", headers=page)
            wrong = await c.post("/ui/ticket", headers={**page, "Authorization": "Bearer nope"})
            given = await c.post("/ui/ticket", headers={**page, "Authorization": "Bearer k-123"})
            opened = await first_line(c, cookies={"memvisor_events": given.cookies["memvisor_events"]})
            forged = await first_line(c, cookies={"memvisor_events": "guess"})
        return session, without, refused, wrong, given, opened, forged

    session, without, refused, wrong, given, opened, forged = keyed_server.run(main())
    assert session["key_required"] is True
    assert without[0] == 401 and forged[0] == 401
    assert_openai_error(refused, 401, "missing_api_key")
    assert_openai_error(wrong, 401, "invalid_api_key")
    assert given.status_code == 204
    cookie = given.headers["set-cookie"]
    for part in ("HttpOnly", "SameSite=Strict", "Path=/v1/events"):
        assert part in cookie
    assert "k-123" not in cookie
    assert opened[0] == 200 and opened[1].startswith(("event:", "id:", "retry:", ":", "data:"))


def test_routes_without_v1_and_the_token_routes_need_the_api_key(keyed_server):
    """Keyed like /v1: no key is a 401; with it the request reaches its handler (no models
    here: `model` is then required, a 400 naming it)."""
    async def main():
        async with keyed_server.client() as c:
            bare = [await c.post(path, json={"content": "x"}) for path in ("/tokenize", "/detokenize", "/infill")]
            bare.append(await c.get("/models"))
            keyed = [await c.post(path, json={"content": "x"} if path == "/tokenize" else {"input_prefix": "x"},
                                  headers={"Authorization": "Bearer k-123"}) for path in ("/tokenize", "/infill")]
        return bare, keyed

    bare, keyed = keyed_server.run(main())
    assert [r.status_code for r in bare] == [401, 401, 401, 401]
    for r in keyed:
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
