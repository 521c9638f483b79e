"""Hostile files in a models folder are refused quickly, never waited on.

A named pipe called `model.safetensors` froze the supervisor for good (its
open() waited for a writer), a 4 KB sparse GGUF claiming billions of empty
keys kept it parsing for 15.6 s, and a 1 GiB sparse config.json was read
whole. Each case runs on a thread with a deadline, so a regression fails here
instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from shared.gguf import GGUFError, read_header
from shared.modelinfo import context_length
from shared.weights import WeightsError, estimate_weight_bytes, kv_bytes_per_token, tensor_bytes
from supervisor.config import Config, SupervisorConfig
from supervisor.models.discovery import with_discovered
from tests import model_files


def within(seconds: float, fn, *args):
    """fn(*args) on a daemon thread; its result or exception, or a failure after `seconds`."""
    out: dict = {}

    def work():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{fn.__name__} still running after {seconds} s")
    out["seconds"] = time.monotonic() - started
    return out


def _unblock(fifo: Path) -> None:
    """Let a reader stuck on the pipe go (a regression's thread), then remove it."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                                    "hidden_size": 8, "max_position_embeddings": 64}))
    return folder


def test_a_named_pipe_as_model_safetensors_is_refused_not_waited_on(model_dir):
    fifo = model_dir / "model.safetensors"
    os.mkfifo(fifo)
    try:
        out = within(3.0, estimate_weight_bytes, model_dir)
    finally:
        _unblock(fifo)
    assert isinstance(out.get("error"), WeightsError) and "named pipe" in str(out["error"])


def test_a_named_pipe_as_config_json_is_refused_not_waited_on(model_dir):
    (model_dir / "config.json").unlink()
    fifo = model_dir / "config.json"
    os.mkfifo(fifo)
    try:
        out = within(3.0, context_length, model_dir)
        kv = within(3.0, kv_bytes_per_token, model_dir)
    finally:
        _unblock(fifo)
    assert out.get("value", "hung") is None and kv.get("value", "hung") == 0


def test_a_named_pipe_as_a_gguf_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    try:
        out = within(3.0, read_header, fifo)
    finally:
        _unblock(fifo)
    assert isinstance(out.get("error"), GGUFError) and "named pipe" in str(out["error"])


def test_a_sparse_config_json_of_1_gib_is_not_read(model_dir):
    with open(model_dir / "config.json", "r+b") as handle:
        handle.truncate(1 << 30)  # sparse: the disk holds a few KB
    out = within(3.0, kv_bytes_per_token, model_dir)
    assert out.get("value") == 0 and out["seconds"] < 1.0
    assert within(3.0, context_length, model_dir).get("value", "hung") is None


def _sparse_gguf(path: Path, n_kv: int, size: int = 1 << 30) -> Path:
    with open(path, "wb") as handle:
        handle.write(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv))
        handle.truncate(size)  # zeros: empty keys of type uint8, as many as the file holds
    return path


def test_a_sparse_gguf_claiming_millions_of_keys_is_refused_at_once(tmp_path):
    out = within(10.0, read_header, _sparse_gguf(tmp_path / "m.gguf", n_kv=1 << 28))
    assert isinstance(out.get("error"), GGUFError) and "implausible" in str(out["error"])
    assert out["seconds"] < 1.0


def test_a_gguf_array_claiming_millions_of_strings_is_refused_at_once(tmp_path):
    path = tmp_path / "a.gguf"
    with open(path, "wb") as handle:  # one key "k": an array of 2**30 (empty) strings
        handle.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
                     + struct.pack("<IIQ", 9, 8, 1 << 30))
        handle.truncate(1 << 30)
    out = within(10.0, read_header, path)
    assert isinstance(out.get("error"), GGUFError) and "claims" in str(out["error"])
    assert out["seconds"] < 1.0


def test_a_safetensors_header_longer_than_its_file_is_refused_without_reading(model_dir):
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", 90 * 1024 * 1024) + b"{}")
    with pytest.raises(WeightsError, match="implausible safetensors header length"):
        tensor_bytes(model_dir / "model.safetensors")


def test_a_folder_name_that_is_no_model_id_is_served_sanitised_not_a_traceback(tmp_path):
    """Before: `My Model (4bit)` raised out of with_discovered and `serve` exited with a traceback."""
    for name in ("My Model (4bit)", "ok-model", "((("):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        model_files.safetensors(folder / "model.safetensors")
    config, warnings = with_discovered(Config(supervisor=SupervisorConfig(models_dirs=[str(tmp_path)])))
    assert {m.id for m in config.models} == {"My-Model-4bit", "ok-model"}
    assert any("'My Model (4bit)'" in w and "'My-Model-4bit'" in w for w in warnings)
    assert any("'((('" in w and "skipped" in w for w in warnings)


def test_weight_estimates_are_read_once_until_the_files_change(model_dir):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    weights = model_dir / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert estimate_weight_bytes(model_dir) == 16
    header = json.dumps({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}).encode()
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 32)
    assert estimate_weight_bytes(model_dir) == 32  # size changed: read again
