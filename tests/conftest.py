"""Shared fixtures.

Tiny models are generated once per test session (seconds, no download) so
every test that needs a real MLX model uses the same few files.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.sizes import MiB


class TinyModels(msgspec.Struct, frozen=True):
    """Paths of the session's generated models (all llama, float16, BPE tokenizer)."""

    a: Path       # 2 MiB of weights, seed 0
    b: Path       # 2 MiB of weights, seed 1 (same dims, other bytes)
    small: Path   # 4 MiB of weights, seed 2 (a bigger second model)
    size_bytes: int = 2 * MiB


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    from worker.modelgen import make_model

    root = tmp_path_factory.mktemp("models")
    make_model(root / "tiny-a", 2 * MiB, 0)
    make_model(root / "tiny-b", 2 * MiB, 1)
    make_model(root / "tiny-small", 4 * MiB, 2)
    return TinyModels(a=root / "tiny-a", b=root / "tiny-b", small=root / "tiny-small")


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    """The one model most tests need."""
    return tiny_models.a


@pytest.fixture
def runtime_dir(tmp_path_factory) -> Path:
    # ipc:// paths must stay short (108 bytes on Linux)
    return Path(tmp_path_factory.mktemp("rt", numbered=True))
