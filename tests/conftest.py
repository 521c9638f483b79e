"""Shared fixtures, for tests/ and tests/live/ alike (tests/README.md).

Tiny models are generated once per test session (seconds, no download) so
every test that needs a real MLX model uses the same few files.

The live front-door modules (a real supervisor and its HTTP server, see
http_harness.py) share `server`, `token_server` and
`no_front_door_errors` from here.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest

from shared.probe import blas_plan as found
from shared.sizes import MiB
from worker import blas

REPO = Path(__file__).resolve().parent.parent

# The tests that run MLX in this process get the workers' OpenBLAS too (or they crawl); it must be
# opened before any test module imports mlx.core (MEMVISOR_BLAS=stock keeps MLX's own).
blas.preload()


def _cache_root(root: Path) -> Path:
    """`root` as a MEMVISOR_CACHE whose BLAS copy is the session's: a private `blas/` of hard
    links to the copy staged once in the session's root, which a worker verifies as it would
    its own copy (SPEC H5.3: a linked folder, as these roots used to have, is refused)."""
    if _STAGED is not None:
        blas.share_copy(root, _STAGED)
    return root


# Workers keep their prompt cache's disk tier (H5) under MEMVISOR_CACHE: the tests' workers,
# those of module-scoped servers too, never write into the user's ~/.cache ...
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="memvisor-test-cache-"))
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
_LOADED = blas.in_use()  # staged once, from the user's copy this process verified
_STAGED = (_SESSION_CACHE / "blas" / Path(_LOADED.path).name
           if _LOADED is not None and blas.share_copy(_SESSION_CACHE) else None)
os.environ[found.CACHE_ENV] = str(_cache_root(_SESSION_CACHE))


@pytest.fixture(autouse=True)
def private_cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """... and each test's own workers get a folder of their own: a stop in one test must not
    hand cached tokens to the next."""
    root = _cache_root(tmp_path_factory.mktemp("cache", numbered=True))
    monkeypatch.setenv(found.CACHE_ENV, str(root))
    return root


class TinyModels(msgspec.Struct, frozen=True):
    """Paths of the session's generated models (all llama, float16, BPE tokenizer)."""

    a: Path       # 2 MiB of weights, seed 0
    b: Path       # 2 MiB of weights, seed 1 (same dims, other bytes)
    small: Path   # 4 MiB of weights, seed 2 (a bigger second model)
    size_bytes: int = 2 * MiB


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    from modelfiles.modelgen import make_model

    root = tmp_path_factory.mktemp("models")
    make_model(root / "tiny-a", 2 * MiB, 0)
    make_model(root / "tiny-b", 2 * MiB, 1)
    make_model(root / "tiny-small", 4 * MiB, 2)
    return TinyModels(a=root / "tiny-a", b=root / "tiny-b", small=root / "tiny-small")


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    """The one model most tests need."""
    return tiny_models.a


@pytest.fixture(scope="session")
def quantized(tmp_path_factory) -> dict[int, Path]:
    """4- and 8-bit quantized tiny models, built by the script in a child process: training the
    tokenizer in this process after a live supervisor ran here can deadlock (a leaked ZeroMQ
    context finalized on a tokenizers thread)."""
    root = tmp_path_factory.mktemp("quantized")
    for bits in (4, 8):
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_model.py"), str(root / f"q{bits}"),
                        "--size", "4MiB", "--seed", "5", "--quantize", str(bits), "--quiet"],
                       check=True, capture_output=True)
    return {bits: root / f"q{bits}" for bits in (4, 8)}


TINY_VLM_DIMS = ("VisionDims(hidden=128, layers=2, intermediate=256, heads=2, kv_heads=1, vision_hidden=64, "
                 "vision_layers=2, vision_intermediate=128, vision_heads=2, patch=16, tile=64, scale=2, tiles=2)")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny SmolVLM (modelfiles/vlmgen.py: 4 image tokens a tile, up to 2x2 tiles and a global one),
    written by a child process for the reason `quantized` gives."""
    path = tmp_path_factory.mktemp("vlm") / "tiny-vlm"
    subprocess.run([sys.executable, "-c", "from modelfiles.vlmgen import VisionDims, make_vision_model; "
                    f"make_vision_model({str(path)!r}, {TINY_VLM_DIMS}, seed=7)"],
                   check=True, capture_output=True, cwd=REPO)
    return path


@pytest.fixture(scope="module")
def loaded(tiny_model):
    """`tiny_model` loaded in this process by mlx-lm: (model, tokenizer), once per test module."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


@pytest.fixture
def runtime_dir(tmp_path_factory) -> Path:
    # ipc:// paths must stay short (108 bytes on Linux)
    return Path(tmp_path_factory.mktemp("rt", numbered=True))


# ---------------------------------------------------------------------------
# live front door (http_harness.LiveServer)


@pytest.fixture
def no_front_door_errors(caplog):
    """No test may leave a bug behind that a client would have seen as a 500.

    A live front-door module takes it for all its tests:
    `pytestmark = pytest.mark.usefixtures("no_front_door_errors")`."""
    from tests.http_harness import front_door_errors

    yield
    assert front_door_errors(caplog.get_records("call")) == []


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    """A real supervisor serving the tiny model as "a", one per test module.

    A module that needs other models or settings defines its own `server`
    fixture, which pytest uses there instead of this one."""
    from supervisor.config import ModelConfig
    from tests.http_harness import LiveServer, make_config

    models = [ModelConfig(id="a", path=str(tiny_models.a))]
    with LiveServer(make_config(models), tmp_path_factory.mktemp("rt")) as live:
        yield live


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """A real supervisor with no models whose admin routes need http_harness.ADMIN_TOKEN."""
    from tests.http_harness import ADMIN_TOKEN, LiveServer, make_config

    with LiveServer(make_config([], admin_token=ADMIN_TOKEN), tmp_path_factory.mktemp("rt")) as live:
        yield live


@pytest.fixture(scope="session")
def fim_model(tmp_path_factory) -> Path:
    """A tiny model whose tokenizer has StarCoder's fill-in-the-middle tokens."""
    from modelfiles.modelgen import FIM_TOKENS, make_model

    path = tmp_path_factory.mktemp("models") / "tiny-fim"
    make_model(path, 2 * MiB, 3, extra_special=FIM_TOKENS)
    return path
