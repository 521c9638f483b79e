"""`serve` refuses what it cannot set up with one clear line and exit code 2,
and leaves no socket behind (a failing TCP PUB bind used to raise
NameError, because the arbiter caught a BusError it had not imported)."""

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_taken_pub_tcp_port_is_a_clean_error(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    config = tmp_path / "memvisor.toml"
    config.write_text(f'[supervisor]\npub_tcp = "127.0.0.1:{port}"\n')
    runtime = tmp_path / "run"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "supervisor", "serve", "--config", str(config), "--http", "off",
             "--runtime-dir", str(runtime)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
    finally:
        taken.close()
    assert out.returncode == 2, out.stderr
    assert f"cannot bind PUB on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr and "NameError" not in out.stderr
    assert not list(runtime.glob("*.sock")), "the failed start left sockets behind"


def test_a_model_path_that_is_missing_or_a_file_stops_serve_at_start(tmp_path):
    """Before: found only when a worker tried to load it (a 500 at the first request)."""
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"x")
    config = tmp_path / "memvisor.toml"
    config.write_text(f'[[models]]\nid = "gone"\npath = "{tmp_path / "absent"}"\n'
                      f'[[models]]\nid = "file"\npath = "{afile}"\n')
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(config), "--http", "off",
         "--runtime-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert f"models[0].path: {tmp_path / 'absent'}: no such file or folder" in out.stderr
    assert "models[1].path: " in out.stderr and "not a model folder" in out.stderr
    assert "Traceback" not in out.stderr


def _serve(tmp_path: Path, *extra: str, runtime: str = "run", timeout: float = 60):
    config = tmp_path / "memvisor.toml"
    if not config.exists():
        config.write_text("[supervisor]\n")
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(config), "--runtime-dir",
         str(tmp_path / runtime), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )


def test_a_taken_http_port_is_one_line_naming_the_address_and_the_http_flag(tmp_path):
    """Before: 70 lines, six ZMQError tracebacks from Bus._drain on the closed sockets, then
    "cannot listen on ...: Address already in use" with no remedy."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        out = _serve(tmp_path, "--http", f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
    assert "--http HOST:PORT" in lines[0]
    assert "Traceback" not in out.stderr


def test_a_second_serve_on_a_runtime_dir_in_use_is_one_line_naming_the_runtime_dir_flag(tmp_path):
    config = tmp_path / "memvisor.toml"
    config.write_text("[supervisor]\n")
    runtime = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config", str(config), "--http", "off",
                              "--runtime-dir", str(runtime)], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (runtime / "endpoints.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first supervisor did not start"
            time.sleep(0.1)
        out = _serve(tmp_path, "--http", "off")
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert f"pid {first.pid}" in lines[0] and str(runtime) in lines[0] and "--runtime-dir" in lines[0]


def test_a_front_door_that_cannot_bind_after_the_bus_started_logs_no_traceback(tmp_path, caplog):
    """The arbiter's own bind (the port taken between serve's check and it): the sockets it
    had attached close with drains still scheduled, which raised ZMQError in the loop."""
    from supervisor.arbiter import Arbiter
    from supervisor.config import Config, SupervisorConfig
    from supervisor.http.server import FrontDoorError

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    config = Config(supervisor=SupervisorConfig(http=f"127.0.0.1:{taken.getsockname()[1]}"))
    try:
        with pytest.raises(FrontDoorError):
            asyncio.run(Arbiter(config, tmp_path / "run", max_workers=4, http=True).run())
    finally:
        taken.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_models_folder_that_is_missing_stops_serve_naming_the_flag_and_the_folder(tmp_path):
    """Before: a typo in --models-dir served zero models behind one WARNING."""
    out = _serve(tmp_path, "--http", "off", "--models-dir", str(tmp_path / "modles"))
    assert out.returncode == 2, out.stderr
    assert f"--models-dir: {tmp_path / 'modles'}: no such folder" in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_a_models_folder_in_the_config_that_is_a_file_stops_serve_with_its_key_path(tmp_path):
    afile = tmp_path / "models.txt"
    afile.write_text("x")
    config = tmp_path / "memvisor.toml"
    config.write_text(f'[supervisor]\nmodels_dirs = ["{tmp_path}", "{afile}"]\n')
    out = _serve(tmp_path, "--http", "off")
    assert out.returncode == 2, out.stderr
    assert f"{config}: supervisor.models_dirs[1]: {afile}: not a folder" in out.stderr
