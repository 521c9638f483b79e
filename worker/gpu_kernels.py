"""MLX's compiled GPU kernels kept in a folder of ours, never in the shared temporary folder.

Why: MLX's CUDA backend compiles a kernel the first time a process meets a
shape it has none for (NVRTC; seconds each: the first speculative checks on an
H100 decoded at 3 tok/s) and keeps the result in `$MLX_PTX_CACHE_DIR`, by
default `<tmp>/mlx/<version>/ptx`, from where every later process on the
machine loads it as GPU code, unchecked. A folder there that another local
user made first, or may write into, would have our worker run their code. So
each worker, before its first computation, points MLX at `kernels/<mlx
version>` under the caches folder, made and checked as the rest of it
(`shared/private_files.py`: 0700, ours, no links). A folder the user named in
`MLX_PTX_CACHE_DIR` is used when it passes the same checks. When the folder
is refused, the worker compiles into a private temporary folder of its own
(removed at exit): it pays the compile again, and loads nothing it did not
write. On Metal and on the CPU, MLX keeps no such files and nothing is done.

MLX is passed in (`mx`), so the rule is tested on a machine without CUDA.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from shared import private_files

log = logging.getLogger("memvisor.worker.gpu_kernels")

KERNELS_ENV = "MLX_PTX_CACHE_DIR"  # MLX's own variable (mlx/backend/cuda/jit_module.cpp)


def uses_cuda(mx: Any) -> bool:
    """Whether this MLX computes with its CUDA backend (the only one that keeps compiled kernels)."""
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:  # an MLX without the module: no CUDA backend
        return False


def keep_private(mx: Any) -> Path | None:
    """Point MLX's kernel cache at a private folder before the first computation; the folder
    (None where MLX keeps no kernels). Never raises: at worst a private temporary folder."""
    if not uses_cuda(mx):
        return None
    named = os.environ.get(KERNELS_ENV)
    try:
        if named:
            private_files.private_folder(Path(named))
            folder = Path(named)
        else:
            folder = private_files.private_path(private_files.cache_root(), "kernels", _mlx_version())
    except OSError as exc:  # NotPrivate (a link, another user's, writable by others) or cannot be made
        folder = Path(tempfile.mkdtemp(prefix="memvisor-kernels-"))  # 0700, a fresh name
        atexit.register(shutil.rmtree, folder, True)
        log.warning("GPU kernels are compiled into %s for this worker only: %s", folder, exc)
    os.environ[KERNELS_ENV] = str(folder)
    return folder


def _mlx_version() -> str:
    """The installed MLX's version (MLX's own default folder is per version too)."""
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return "unknown"
