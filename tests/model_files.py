"""The smallest model files discovery accepts (it reads each header and refuses one that
lies or declares no tensor data, so a test file must be honest), for tests without MLX."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors(path: Path) -> Path:
    """A safetensors file with one float32 tensor of 4 values."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    return path


def gguf(path: Path) -> Path:
    """A GGUF v3 file with one F32 tensor of 4 values (ggml type 0)."""
    text = lambda s: struct.pack("<Q", len(s.encode())) + s.encode()  # noqa: E731
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    head += text("general.architecture") + struct.pack("<I", 8) + text("llama")
    head += text("w") + struct.pack("<I", 1) + struct.pack("<Q", 4) + struct.pack("<IQ", 0, 0)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * 16)
    return path
