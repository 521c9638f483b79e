"""Bad command-line input is a clear error, never a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec

from shared import protocol as p
from supervisor.config import ModelConfig
from supervisor.wiring.control_answers import MAX_CONTEXT_TOKENS, handle_control
from tests.arbiter_harness import Running, make_config

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


def memvisor(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *argv], capture_output=True, text=True,
                          timeout=60, env=ENV)


def test_status_with_a_file_as_runtime_dir_is_a_clear_error_not_a_traceback(tmp_path):
    """Before: NotADirectoryError: [Errno 20] Not a directory: '.../endpoints.json' and its traceback."""
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    for argv in (["status"], ["reload"], ["load", "a"]):
        out = memvisor(*argv, "--runtime-dir", str(file))
        assert out.returncode == 3, (argv, out.stderr)
        assert "is not a folder" in out.stderr and "Traceback" not in out.stderr


def test_load_context_over_2_to_the_64_is_a_clear_error_not_a_traceback(tmp_path):
    """Before: OverflowError: can't serialize ints > 2**64 - 1, with its traceback."""
    out = memvisor("load", "a", "--dry-run", "--context", str(2**65), "--runtime-dir", str(tmp_path))
    assert out.returncode == 2 and "--context" in out.stderr and "Traceback" not in out.stderr


def test_a_dry_run_context_past_the_cap_is_refused_on_the_control_socket(tiny_models, runtime_dir):
    """The control door refuses it too (another client than ours may send 2**63): before,
    the report's size overflowed its encoding and the answer was an internal error."""
    async def main():
        async with Running(make_config([ModelConfig(id="a", path=str(tiny_models.a))]), runtime_dir) as arb:
            reply = await handle_control(arb.service, p.LoadRequest(model="a", dry_run=True, context=2**63 - 1))
            assert isinstance(reply, p.ControlError) and reply.code == "invalid_request"
            assert str(MAX_CONTEXT_TOKENS) in reply.message
            msgspec.msgpack.encode(reply)  # answerable

    asyncio.run(main())
