"""`chat` against a real `serve` process: one prompt for scripts, and a session on a terminal.

The chat runs as its own process (a pty where a person would type), the
supervisor as another; the model is the session's tiny one (random weights:
its words mean nothing, their arrival does). A recording proxy between them
shows what each turn sent, so the session's history and `/clear` are seen in
the requests themselves while the answers come from the real server.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from shared.sizes import MiB
from tests.chat_harness import ROOT, RecordingProxy, Serving, Terminal, cli_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """Weights that take a visible moment to load (the progress line has something to show)."""
    from modelfiles.modelgen import make_model

    path = tmp_path_factory.mktemp("big") / "big"
    make_model(path, 64 * MiB, 11)
    return path


@pytest.fixture(scope="module")
def serving(tiny_models, big_model, tmp_path_factory):
    toml = f"""
[guard]
hot_cache_max = 0
[supervisor]
http = "127.0.0.1:0"
spare_workers = 0  # a load from a fresh process: long enough for the chat to show its progress
[[models]]
id = "tiny"
path = "{tiny_models.a}"
[[models]]
id = "big"
path = "{big_model}"
"""
    with Serving(toml, tmp_path_factory.mktemp("serve")) as running:
        yield running


def chat(serving, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "chat", *args, "--runtime-dir",
                           str(serving.runtime_dir)], input=stdin, capture_output=True, text=True, cwd=ROOT,
                          env=cli_env(), timeout=180)


def greedy_answer(serving, prompt: str, tokens: int) -> str:
    """The same question asked of /api/chat directly, not streamed."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "stream": False,
            "options": {"num_predict": tokens, "temperature": 0}}
    return httpx.post(serving.url + "/api/chat", json=body, timeout=120).json()["message"]["content"]


def test_chat_one_prompt_prints_the_answer_and_exits_0(serving):
    """The streamed pieces, printed, are the answer the API gives (and a newline)."""
    done = chat(serving, "tiny", "Say hello", "--max-tokens", "6", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == greedy_answer(serving, "Say hello", 6) + "\n" and done.stderr == ""


def test_chat_reads_the_prompt_from_stdin_when_it_is_not_a_terminal(serving):
    done = chat(serving, "tiny", "--max-tokens", "4", "--temperature", "0", stdin="What is 2 + 2?")
    assert done.returncode == 0, done.stderr
    assert done.stdout == greedy_answer(serving, "What is 2 + 2?", 4) + "\n"


def test_chat_failures_are_one_line_and_exit_1(serving, tmp_path):
    unknown = chat(serving, "no-such-model", "hi")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "no-such-model" in unknown.stderr
    nobody = subprocess.run([sys.executable, "-m", "supervisor", "chat", "tiny", "hi", "--runtime-dir",
                             str(tmp_path / "none")], capture_output=True, text=True, cwd=ROOT, env=cli_env(), timeout=60)
    assert nobody.returncode == 1 and "memvisor serve" in nobody.stderr and "Traceback" not in nobody.stderr


def test_chat_session_keeps_history_takes_several_lines_and_clears(serving):
    """A person's session on a terminal: `\\` and a \"\"\" block make one message each, each
    turn sends the conversation so far, /clear forgets it, /bye leaves with 0."""
    with RecordingProxy(serving.url) as proxy:
        term = Terminal([sys.executable, "-m", "supervisor", "chat", "tiny", "--url", proxy.url,
                         "--max-tokens", "5"], cli_env())
        term.expect(">>> ")
        term.send("first line \\\n")
        term.expect("... ")
        term.send("second line\n")
        term.expect(">>> ")
        term.send('"""\nblock one\nblock two\n"""\n')
        term.expect(">>> ")
        term.send("/clear\n")
        term.expect("forgotten")
        term.send("after clear\n")
        term.expect(">>> ")
        term.send("/bye\n")
        assert term.wait() == 0
    users = [[m["content"] for m in body["messages"] if m["role"] == "user"] for body in proxy.chats]
    assert users == [["first line \nsecond line"], ["first line \nsecond line", "block one\nblock two"],
                     ["after clear"]]
    assert [m["role"] for m in proxy.chats[1]["messages"]] == ["user", "assistant", "user"]


def test_chat_session_shows_the_load_and_streams_then_ctrl_d_leaves(serving):
    """A model not loaded yet: a progress line while it loads (/health?model=), then the
    reply; Ctrl-D at the prompt leaves with 0."""
    httpx.post(serving.url + "/v1/models/big/unload", timeout=60)
    term = Terminal([sys.executable, "-m", "supervisor", "chat", "big", "--runtime-dir", str(serving.runtime_dir),
                     "--max-tokens", "4"], cli_env())
    term.expect(">>> ")
    started = time.monotonic()
    term.send("hello\n")
    shown = term.expect(">>> ", timeout=180)
    assert "loading big" in shown, shown
    assert time.monotonic() - started > 0.5
    term.send("\x04")  # Ctrl-D
    assert term.wait() == 0
