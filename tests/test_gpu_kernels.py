"""MLX's compiled GPU kernels live in a private folder of ours (worker/gpu_kernels.py): MLX's CUDA
backend loads what it finds in its kernel cache as code, and its default is the shared temporary
folder. The rule is the caches folder's (shared/private_files.py), checked with a stand-in for
MLX that says it has CUDA, since this machine has none."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from worker import gpu_kernels
from worker.gpu_kernels import KERNELS_ENV, keep_private


def _mx(cuda: bool) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: cuda))


@pytest.fixture
def caches(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MEMVISOR_CACHE", str(root))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    return root


def test_gpu_kernels_are_compiled_into_a_private_folder_of_the_caches_folder(caches):
    folder = keep_private(_mx(cuda=True))
    assert folder == caches / "kernels" / gpu_kernels._mlx_version()
    assert os.environ[KERNELS_ENV] == str(folder)
    for path in (caches, caches / "kernels", folder):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_gpu_kernels_a_folder_others_may_write_is_refused_for_a_private_one_of_the_worker(caches, tmp_path,
                                                                                             monkeypatch):
    shared = tmp_path / "shared-ptx"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(KERNELS_ENV, str(shared))
    folder = keep_private(_mx(cuda=True))
    assert folder is not None and folder != shared
    assert os.environ[KERNELS_ENV] == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert not any(folder.iterdir()), "a fresh folder: nothing compiled by anyone else"


def test_gpu_kernels_a_linked_caches_folder_is_never_followed(caches, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    caches.symlink_to(elsewhere)
    folder = keep_private(_mx(cuda=True))
    assert folder is not None and not str(folder).startswith(str(caches))
    assert not (elsewhere / "kernels").exists()


def test_gpu_kernels_a_folder_the_user_named_is_used_when_it_is_private(caches, tmp_path, monkeypatch):
    named = tmp_path / "my-ptx"
    named.mkdir(mode=0o700)
    monkeypatch.setenv(KERNELS_ENV, str(named))
    assert keep_private(_mx(cuda=True)) == named
    assert os.environ[KERNELS_ENV] == str(named)


def test_gpu_kernels_without_cuda_nothing_is_made_or_set(caches):
    assert keep_private(_mx(cuda=False)) is None
    assert keep_private(SimpleNamespace()) is None  # an MLX without the cuda module
    assert KERNELS_ENV not in os.environ and not caches.exists()
