"""`serve` refuses what it cannot set up with one clear line and exit code 2,
and leaves no socket behind (a failing TCP PUB bind used to raise
NameError, because the arbiter caught a BusError it had not imported)."""

import socket
import subprocess
import sys
from pathlib import Path

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
