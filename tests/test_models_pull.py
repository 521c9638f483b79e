"""`pull`, `rm`, `/api/pull` and `/api/delete` against a hub on loopback (tests/hub_harness.py).

huggingface_hub runs for real (no hub is reachable here): the hub harness answers
its listing, HEAD and ranged GET requests and counts what it sends. No model is
loaded in this file (no worker starts), so it runs with the fast suite; a pulled
model answering a chat is tests/live/test_models_pull_live.py.

What is pinned: a name is checked before it reaches a URL or a path; what a
repo offers is chosen as documented (MLX folder, one GGUF by tag); a model
that could never fit (SPEC A3's "model too large", judged on the stable
ceiling: supervisor/models/hub_fit.py) is refused before any weight byte; a download
dropped part-way resumes with a Range request, within one pull and across two;
the result is byte-identical; the Ollama routes stream the progress its client
reads, need the admin token when one is set, and delete only what was pulled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ollama
import pytest

from shared.gguf import read_header
from shared.sizes import GiB, MiB
from supervisor.config import ModelConfig
from supervisor.models import pulled
from supervisor.models.hub_fit import Room, refusal
from supervisor.models.hub_repo import Listing, RefError, RepoFile, choose, parse_ref, plan_for
from tests.http_harness import ADMIN_TOKEN, make_config
from tests.hub_harness import FakeHub, Virtual, gguf_header, pull_server

pytestmark = pytest.mark.usefixtures("no_front_door_errors")

REPO = Path(__file__).resolve().parent.parent
COMMIT = "a" * 40


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as running:
        yield running


@pytest.fixture
def hf(tmp_path, monkeypatch, hub) -> Path:
    """This test's hub cache and HF home (no token of the user's reaches the fake hub)."""
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return cache


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """24 MiB of weights: many of the 1 MiB chunks a pull reads (supervisor/models/hub_fetch.py), so a
    dropped connection leaves whole chunks on disk to resume from."""
    from modelfiles.modelgen import make_model

    path = tmp_path_factory.mktemp("big") / "model"
    make_model(path, 24 * MiB, 7)
    return path


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "supervisor", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def snapshot_of(cache: Path, repo: str) -> Path:
    commit = (cache / f"models--{repo.replace('/', '--')}" / "refs" / "main").read_text()
    return cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def same_files(snapshot: Path, folder: Path) -> bool:
    return all((snapshot / f.name).read_bytes() == f.read_bytes() for f in folder.iterdir() if f.is_file())


# ---------------------------------------------------------------------------
# names and choices (no network)


@pytest.mark.parametrize("name", ["../etc/passwd", "/home/me/model", "~/model", "https://huggingface.co/a/b",
                                  "www.example.com/a", "org--x/name", "org/name/extra", "org", "org/na me",
                                  "org/name:Q4 K", "org/name@../../x", "org\\name", "", ".hidden/x"])
def test_pull_refuses_names_that_are_not_hub_repos(name):
    """A name is input: no URL, path, `..`, `--` (the cache's separator) or stray character
    ever reaches a URL or a cache folder."""
    with pytest.raises(RefError):
        parse_ref(name)


def test_pull_names_take_ollama_forms():
    assert parse_ref("hf.co/Org/Name:Q4_K_M") == parse_ref("Org/Name:Q4_K_M")
    assert parse_ref("Org/Name:Q4_K_M").model_id == "Org/Name:Q4_K_M"
    assert parse_ref("Org/Name:latest").model_id == "Org/Name"  # clients append :latest
    assert parse_ref("Org/Name@v1.0").revision == "v1.0"
    with pytest.raises(RefError):
        parse_ref("Org/Name:Q4_K_M", file="x.gguf")


def _listing(*names_sizes: tuple[str, int]) -> Listing:
    return Listing(repo="o/r", commit=COMMIT, files=tuple(RepoFile(name=n, size=s) for n, s in names_sizes))


def test_pull_chooses_an_mlx_folder_with_its_side_files_only():
    listing = _listing(("config.json", 1), ("model-00001-of-00002.safetensors", 10), ("model-00002-of-00002.safetensors", 5),
                       ("tokenizer.json", 2), ("README.md", 3), ("pytorch_model.bin", 99), ("onnx/model.onnx", 50))
    plan = choose(parse_ref("o/r"), listing)
    assert plan.kind == "mlx" and plan.weight_bytes == 15
    assert sorted(f.name for f in plan.files) == ["config.json", "model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors", "tokenizer.json"]


def test_pull_chooses_one_gguf_by_tag_or_q4_k_m_never_a_shard_or_projector():
    listing = _listing(("m-Q8_0.gguf", 8), ("m-Q4_K_M.gguf", 4), ("m-Q4_K_S.gguf", 3), ("mmproj-m-f16.gguf", 1),
                       ("big/m-Q2_K-00001-of-00002.gguf", 2))
    assert choose(parse_ref("o/r"), listing).gguf == "m-Q4_K_M.gguf"
    assert choose(parse_ref("o/r:q8_0"), listing).gguf == "m-Q8_0.gguf"
    assert choose(parse_ref("o/r", file="m-Q4_K_S.gguf"), listing).gguf == "m-Q4_K_S.gguf"
    with pytest.raises(RefError, match="Q2_K"):  # a split file is not offered: the tags named are the others
        choose(parse_ref("o/r:Q2_K"), listing)
    with pytest.raises(RefError, match="neither an MLX model"):
        choose(parse_ref("o/r"), _listing(("pytorch_model.bin", 9), ("config.json", 1)))


# ---------------------------------------------------------------------------
# the CLI, with no supervisor running


def test_pull_cli_fetches_the_model_into_the_hub_cache_and_records_it(hub, hf, tiny_model, runtime_dir):
    hub.add_folder("org/cli-tiny", tiny_model)
    done = cli("pull", "org/cli-tiny", "--runtime-dir", str(runtime_dir))
    assert done.returncode == 0, done.stderr
    snapshot = snapshot_of(hf, "org/cli-tiny")
    assert same_files(snapshot, tiny_model)
    assert "pulled org/cli-tiny" in done.stdout and "memvisor chat org/cli-tiny" in done.stdout
    assert [(m.id, m.path) for m in pulled.read()] == [("org/cli-tiny", snapshot)]
    from supervisor.models.discovery import with_discovered  # served without a config entry

    assert [(m.id, m.path) for m in with_discovered(make_config([]))[0].models] == [("org/cli-tiny", str(snapshot))]


def test_a3_pull_refuses_a_model_that_could_never_fit_before_any_weight_byte(hub, hf, runtime_dir):
    """500 GiB of weights against this machine's stable ceiling: refused with the reason and
    what would fit, and the hub sent not one byte of the weights."""
    hub.add_file("org/cli-huge", "config.json", b"{}")
    hub.add_file("org/cli-huge", "model.safetensors", Virtual(500 * GiB))
    done = cli("pull", "org/cli-huge", "--runtime-dir", str(runtime_dir))
    assert done.returncode == 1
    assert "refused before downloading" in done.stderr and "500 GiB" in done.stderr and "fit" in done.stderr
    assert hub.sent["org/cli-huge/model.safetensors"] == 0
    assert not (hf / "models--org--cli-huge" / "blobs").exists() and pulled.read() == []


@pytest.mark.parametrize("name", ["../x", "https://huggingface.co/org/x", "org--x/y"])
def test_pull_cli_refuses_a_bad_name_with_one_line_and_exit_2(hf, name, runtime_dir):
    done = cli("pull", name, "--runtime-dir", str(runtime_dir))
    assert done.returncode == 2 and done.stderr.startswith("memvisor: ") and "Traceback" not in done.stderr
    assert not hf.exists()


def test_pull_resumes_a_dropped_connection_with_a_range_request(hub, hf, big_model, runtime_dir):
    """The hub drops the connection 15 MiB into the weights, once: the same pull asks for the rest
    with a Range request from what it kept, and the file is byte-identical."""
    hub.add_folder("org/drop", big_model)
    hub.drop_once("org/drop", "model.safetensors", 15 * MiB)
    done = cli("pull", "org/drop", "--runtime-dir", str(runtime_dir))
    assert done.returncode == 0, done.stderr
    assert hub.ranges("model.safetensors") == [f"bytes={15 * MiB}-"]  # all it kept: whole 1 MiB chunks
    assert same_files(snapshot_of(hf, "org/drop"), big_model)


def test_pull_interrupted_resumes_where_it_stopped_on_the_next_pull(hub, hf, big_model, runtime_dir):
    """Ctrl-C part-way through the weights: exit 130, the part fetched stays, and the next pull
    asks only for the rest (a Range request from the kept size); the result is byte-identical."""
    hub.add_folder("org/resume", big_model)
    size = (big_model / "model.safetensors").stat().st_size
    hub.bytes_per_second = 4 * MiB
    try:
        child = subprocess.Popen([sys.executable, "-m", "supervisor", "pull", "org/resume", "--runtime-dir",
                                  str(runtime_dir)], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while hub.sent["org/resume/model.safetensors"] < 14 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _out, err = child.communicate(timeout=30)
    finally:
        hub.bytes_per_second = 0
    assert child.returncode == 130 and "resumes" in err
    kept = [p for p in (hf / "models--org--resume" / "blobs").iterdir() if p.name.endswith(".incomplete")]
    assert len(kept) == 1 and 10 * MiB <= kept[0].stat().st_size < size
    kept_bytes = kept[0].stat().st_size
    done = cli("pull", "org/resume", "--runtime-dir", str(runtime_dir))
    assert done.returncode == 0, done.stderr
    assert hub.ranges("model.safetensors")[-1] == f"bytes={kept_bytes}-"
    assert same_files(snapshot_of(hf, "org/resume"), big_model)
    assert hub.sent["org/resume/model.safetensors"] < 2 * size


def test_pull_sends_the_hub_token_from_the_environment(tmp_path, monkeypatch, tiny_model, runtime_dir):
    """A private repo: without HF_TOKEN the hub refuses (said in words), with it the pull works."""
    with FakeHub(token="hf_test_token") as private:
        private.add_folder("org/private", tiny_model)
        monkeypatch.setenv("HF_ENDPOINT", private.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        refused = cli("pull", "org/private", "--runtime-dir", str(runtime_dir))
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        done = cli("pull", "org/private", "--runtime-dir", str(runtime_dir))
    assert refused.returncode == 1 and "HF_TOKEN" in refused.stderr
    assert done.returncode == 0, done.stderr


def test_pull_follows_the_hubs_redirect_to_storage_without_the_token(tmp_path, monkeypatch, big_model,
                                                                     runtime_dir):
    """As the real hub: an LFS file's URL answers 302 to a storage host. The pull takes the
    etag and size from the redirect's X-Linked-* headers, fetches (and resumes) from storage,
    and never sends the hub token there (it goes to the hub alone)."""
    with FakeHub(token="hf_test_token", cdn=True) as private:
        private.add_folder("org/cdn", big_model)
        private.drop_once("org/cdn", "model.safetensors", 5 * MiB)
        monkeypatch.setenv("HF_ENDPOINT", private.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        done = cli("pull", "org/cdn", "--runtime-dir", str(runtime_dir))
        assert done.returncode == 0, done.stderr
        assert same_files(snapshot_of(tmp_path / "hf" / "hub", "org/cdn"), big_model)
        assert len(private.cdn_authorization) >= 2 and set(private.cdn_authorization) == {""}


def test_rm_removes_a_pulled_model_and_never_anything_else(hub, hf, tiny_model, runtime_dir):
    hub.add_folder("org/rm-me", tiny_model)
    assert cli("pull", "org/rm-me", "--runtime-dir", str(runtime_dir)).returncode == 0
    snapshot = snapshot_of(hf, "org/rm-me")
    other = cli("rm", str(tiny_model), "--runtime-dir", str(runtime_dir))
    assert other.returncode == 1 and "was not pulled" in other.stderr and tiny_model.is_dir()
    done = cli("rm", "org/rm-me:latest", "--runtime-dir", str(runtime_dir))
    assert done.returncode == 0 and "removed org/rm-me" in done.stdout
    assert not snapshot.exists() and not (hf / "models--org--rm-me").exists() and pulled.read() == []


def test_the_pull_record_is_refused_when_others_may_write_it(hub, hf, tiny_model, runtime_dir):
    """The record is input: one another account could have written is not trusted, and
    the catalogue says so instead of serving what it names."""
    hub.add_folder("org/record", tiny_model)
    assert cli("pull", "org/record", "--runtime-dir", str(runtime_dir)).returncode == 0
    pulled.record_path().chmod(0o666)
    with pytest.raises(pulled.RecordError, match="refused"):
        pulled.read()
    from supervisor.models.discovery import with_discovered

    config, warnings = with_discovered(make_config([]))
    assert config.models == [] and any("refused" in w for w in warnings)


# ---------------------------------------------------------------------------
# GGUF: sized by its header before the weights are fetched


def _gguf(kind: str, layers: int) -> tuple[bytes, int]:
    tensors = [(f"blk.{i}.ffn_up.weight", (4096, 1024), kind) for i in range(layers)]
    head, data = gguf_header(tensors)
    return head, len(head) + data


def test_gguf_pull_is_sized_by_its_header_and_a_smaller_quant_is_offered(hub, hf, tmp_path):
    """A K-quant is dequantized to float16 on import (shared.gguf), so its file size understates
    its memory 3.5-fold: the plan reads the header (a few KB by Range) and says what it takes;
    when that cannot fit, the Q4_0 file (kept quantized) is named instead."""
    k_head, k_size = _gguf("Q4_K", 8)
    q_head, q_size = _gguf("Q4_0", 8)
    hub.add_file("org/gguf", "m-Q4_K_M.gguf", Virtual(k_size, k_head))
    hub.add_file("org/gguf", "m-Q4_0.gguf", Virtual(q_size, q_head))
    local = tmp_path / "local.gguf"
    local.write_bytes(Virtual(k_size, k_head).read(0, k_size))
    plan = plan_for(parse_ref("org/gguf"))
    assert plan.gguf == "m-Q4_K_M.gguf" and plan.weight_bytes == read_header(local).mlx_bytes > 3 * k_size
    assert hub.sent["org/gguf/m-Q4_K_M.gguf"] < k_size  # the header only
    room = Room(ever=plan.weight_bytes // 2, now=plan.weight_bytes // 2, pool="host", tier="custom",
                source="a test", remedy="none")
    words = refusal(plan, room)
    assert words is not None and "m-Q4_0.gguf would fit" in words and "org/gguf:Q4_0" in words


# ---------------------------------------------------------------------------
# the Ollama routes on a real supervisor


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_models):
    models = [ModelConfig(id="mine", path=str(tiny_models.b))]
    with pull_server(make_config(models), tmp_path_factory.mktemp("rt")) as live:
        yield live


@pytest.fixture(scope="module")
def token_pull_server(tmp_path_factory):
    with pull_server(make_config([], admin_token=ADMIN_TOKEN), tmp_path_factory.mktemp("rt")) as live:
        yield live


def test_api_pull_streams_ollama_progress_then_serves_the_model(server, hub, hf, tiny_model):
    hub.add_folder("org/api-tiny", tiny_model)

    async def main():
        client = ollama.AsyncClient(host=server.url())
        lines = [line async for line in await client.pull("org/api-tiny", stream=True)]
        return lines, await client.list()

    lines, tags = server.run(main())
    assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
    weights = [x for x in lines if x.status == "pulling model.safetensors"]
    size = (tiny_model / "model.safetensors").stat().st_size
    assert weights[-1].total == weights[-1].completed == size and weights[-1].digest.startswith("sha256:")
    assert {"verifying sha256 digest", "writing manifest"} <= {x.status for x in lines}
    assert "org/api-tiny" in [m.model for m in tags.models]
    assert same_files(snapshot_of(hf, "org/api-tiny"), tiny_model)


def test_api_pull_refuses_before_any_byte(server, hub, hf):
    """400 for a name that is no repo, 404 for one the hub lacks, 507 for one that could
    never fit (SPEC A3), each before the first byte of weights."""
    hub.add_file("org/api-huge", "config.json", b"{}")
    hub.add_file("org/api-huge", "model.safetensors", Virtual(800 * GiB))

    async def main():
        out = {}
        for name in ("../../etc", "org/not-there", "org/api-huge"):
            try:
                await ollama.AsyncClient(host=server.url()).pull(name)
            except ollama.ResponseError as exc:
                out[name] = exc
        return out

    refused = server.run(main())
    assert refused["../../etc"].status_code == 400 and "path" in refused["../../etc"].error
    assert refused["org/not-there"].status_code == 404
    assert refused["org/api-huge"].status_code == 507 and "800 GiB" in refused["org/api-huge"].error
    assert hub.sent["org/api-huge/model.safetensors"] == 0


def test_api_pull_not_streamed_answers_once(server, hub, hf, tiny_model):
    hub.add_folder("org/api-once", tiny_model)
    answer = server.run(ollama.AsyncClient(host=server.url()).pull("org/api-once"))
    assert answer.status == "success"


def test_api_delete_removes_the_snapshot_and_the_model_leaves_tags(server, hub, hf, tiny_model):
    hub.add_folder("org/api-del", tiny_model)

    async def main():
        client = ollama.AsyncClient(host=server.url())
        await client.pull("org/api-del")
        before = [m.model for m in (await client.list()).models]
        snapshot = snapshot_of(hf, "org/api-del")
        await client.delete("org/api-del")
        after = [m.model for m in (await client.list()).models]
        async with httpx.AsyncClient(base_url=server.url()) as raw:
            again = await raw.request("DELETE", "/api/delete", json={"model": "org/api-del"})
            mine = await raw.request("DELETE", "/api/delete", json={"model": "mine"})
        return before, snapshot, after, again, mine

    before, snapshot, after, again, mine = server.run(main())
    assert "org/api-del" in before and "org/api-del" not in after and not snapshot.exists()
    assert again.status_code == 404
    assert mine.status_code == 409 and "never deletes" in mine.json()["error"] and "mine" in after


def test_pull_cli_with_a_running_supervisor_serves_the_model_at_once(server, hub, hf, tiny_model):
    """The CLI pulls in its own process, then asks the supervisor (control socket) to reload."""
    hub.add_folder("org/cli-live", tiny_model)

    async def main():
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor", "pull", "org/cli-live", "--runtime-dir", str(server.arbiter.runtime_dir),
            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await child.communicate()
        async with server.client() as c:
            tags = (await c.get("/api/tags")).json()
        return child.returncode, out.decode(), err.decode(), tags

    code, out, err, tags = server.run(main())
    assert code == 0, err
    assert "org/cli-live" in [m["model"] for m in tags["models"]]


def test_api_pull_and_delete_need_the_admin_token_when_one_is_set(token_pull_server, hub, hf, tiny_model):
    hub.add_folder("org/api-admin", tiny_model)
    bearer = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def main():
        async with token_pull_server.client() as c:
            pull_refused = await c.post("/api/pull", json={"model": "org/api-admin", "stream": False})
            sent_then = hub.sent["org/api-admin/model.safetensors"]
            pulled_ok = await c.post("/api/pull", json={"model": "org/api-admin", "stream": False}, headers=bearer)
            delete_refused = await c.request("DELETE", "/api/delete", json={"model": "org/api-admin"})
            kept = snapshot_of(hf, "org/api-admin").exists()
            deleted = await c.request("DELETE", "/api/delete", json={"model": "org/api-admin"}, headers=bearer)
        return pull_refused, sent_then, pulled_ok, delete_refused, kept, deleted

    pull_refused, sent_then, pulled_ok, delete_refused, kept, deleted = token_pull_server.run(main())
    assert pull_refused.status_code == 401 and sent_then == 0
    assert pulled_ok.status_code == 200 and json.loads(pulled_ok.text)["status"] == "success"
    assert delete_refused.status_code == 401 and kept
    assert deleted.status_code == 200 and not repo_folder_exists(hf, "org/api-admin")


def repo_folder_exists(cache: Path, repo: str) -> bool:
    return (cache / f"models--{repo.replace('/', '--')}").exists()


def test_api_pull_from_a_web_page_is_refused_before_the_hub_is_asked(server, hub, hf):
    """A browser is a client, not an admin: a page of another origin is stopped by the gate
    (403), and one the CORS list allows still may not pull without the admin token."""
    hub.add_file("org/page", "config.json", b"{}")
    asked = len(hub.requests)

    async def main():
        async with server.client() as c:
            foreign = await c.post("/api/pull", json={"model": "org/page"}, headers={"Origin": "http://evil.example"})
            allowed = await c.post("/api/pull", json={"model": "org/page"}, headers={"Origin": "http://localhost:3000"})
            deleted = await c.request("DELETE", "/api/delete", json={"model": "org/page"},
                                      headers={"Origin": "http://localhost:3000"})
        return foreign, allowed, deleted

    foreign, allowed, deleted = server.run(main())
    assert foreign.status_code == 403 and foreign.json()["code"] == "origin_not_allowed"
    assert allowed.status_code == 403 and deleted.status_code == 403 and "admin" in allowed.json()["error"]
    assert len(hub.requests) == asked


def test_api_pull_runs_off_the_loop_and_stops_when_the_client_goes_away(server, hub, hf, big_model):
    """While a slow pull streams, the front door answers at once; when its client disconnects the
    download stops at the next chunk, and what it fetched stays for a resume."""
    hub.add_folder("org/api-gone", big_model)
    size = (big_model / "model.safetensors").stat().st_size
    key = "org/api-gone/model.safetensors"

    async def main():
        hub.bytes_per_second = 4 * MiB
        try:
            async with server.client() as c:
                async with c.stream("POST", "/api/pull", json={"model": "org/api-gone"}) as answer:
                    async for line in answer.aiter_lines():
                        if json.loads(line).get("completed", 0) >= 10 * MiB:
                            break
                        started = time.monotonic()
                        health = await c.get("/health")
                        assert health.status_code == 200 and time.monotonic() - started < 1.0
            await asyncio.sleep(1.0)  # the download hears the cancel at its next chunk
            sent = hub.sent[key]
            await asyncio.sleep(1.5)
            return sent, hub.sent[key]
        finally:
            hub.bytes_per_second = 0

    sent, later = server.run(main())
    assert sent == later < size
    kept = [p for p in (hf / "models--org--api-gone" / "blobs").iterdir() if p.name.endswith(".incomplete")]
    assert len(kept) == 1 and kept[0].stat().st_size >= 10 * MiB
    assert pulled.read() == []
