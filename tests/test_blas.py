"""Linux CPU workers compute with OpenBLAS, not MLX's bundled reference BLAS.

MLX's Linux CPU wheel links netlib's libblas (~2 GFLOP/s float32 matmul);
worker.blas opens OpenBLAS (scipy-openblas32 with its names renamed, or the
system's) with RTLD_GLOBAL before MLX loads, so libmlx binds to it. The speed
itself is measured by scripts/bench_blas.py, never asserted here: these tests
pin that the library is really in the worker (its memory map), that it is the
one probe names, and that greedy output does not change with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shared.probe import blas_plan as found
from tests.blas_harness import linux_only, mapped_paths
from worker import blas

ROOT = Path(__file__).resolve().parent.parent


@linux_only
def test_renamed_copy_exports_the_plain_names_mlx_binds_to(tmp_path, monkeypatch):
    """scipy-openblas32 prefixes every name (`scipy_cblas_sgemm`), which libmlx never asks for."""
    monkeypatch.setenv(found.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(found.ENV, raising=False)
    plan = found.plan()
    assert plan.kind == "renamed" and not plan.ready, plan  # a fresh cache: made at the first start
    before = blas.dynamic_names(Path(plan.source))
    assert "scipy_cblas_sgemm" in before and "cblas_sgemm" not in before
    blas.make_renamed_copy(Path(plan.source), Path(plan.load_path))
    after = set(blas.dynamic_names(Path(plan.load_path)))
    needed = {"cblas_sgemm", "cblas_dgemm", "cblas_cgemm", "sgesdd_", "spotrf_", "sgetrf_", "ssyevd_",
              "openblas_get_config"}
    assert needed <= after
    assert not {n for n in after if n.startswith(found.PREFIX)}
    assert found.plan() == found.BlasPlan(kind="renamed", source=plan.source, load_path=plan.load_path,
                                          origin=plan.origin, ready=True)


def test_stock_chosen_or_no_library_is_stock_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv(found.ENV, "stock")
    assert found.plan().kind == "stock"
    monkeypatch.setenv(found.ENV, str(tmp_path / "missing.so"))
    plan = found.plan()
    assert plan.kind == "stock" and "no such file" in plan.reason


@linux_only
def test_a_library_that_will_not_load_leaves_the_stock_blas_and_a_warning(tmp_path):
    """A worker never fails to start over its BLAS: it says what failed and runs on MLX's own."""
    bogus = tmp_path / "libnot-a-blas.so"
    bogus.write_text("not an ELF file")
    code = "from worker import blas; import json; i = blas.preload(); print(json.dumps([i.kind, i.line()]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=os.environ | {found.ENV: str(bogus)})
    kind, line = json.loads(out.stdout)
    assert kind == "stock" and "could not load a fast BLAS" in line and str(bogus) in line
    assert line in out.stderr  # the warning in the log


def test_system_openblas_is_found_in_the_debian_folders(tmp_path):
    pthread = tmp_path / "x-linux-gnu" / "openblas-pthread"
    pthread.mkdir(parents=True)
    assert found.system_library((str(tmp_path / "{arch}-linux-gnu/openblas-pthread"),)) is None
    (pthread / "libopenblas.so.0").write_bytes(b"")
    arch_dir = str(tmp_path / "x-linux-gnu/openblas-pthread")
    assert found.system_library((arch_dir,)) == pthread / "libopenblas.so.0"


@linux_only
def test_the_test_process_computes_with_openblas():
    """conftest opens the workers' BLAS before any test imports MLX, so in-process tests are fast too."""
    if found.stock_chosen():
        pytest.skip("MEMVISOR_BLAS=stock")
    info = blas.in_use()
    assert info is not None and info.kind != "stock", info
    import mlx.core  # noqa: F401  (the map must still hold it once MLX is in)

    assert info.path in mapped_paths("self")
    assert "OpenBLAS" in info.config and info.threads >= 1


@linux_only
def test_probe_names_the_blas_workers_get():
    out = subprocess.run([sys.executable, "-m", "supervisor", "probe", "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=os.environ | {found.ENV: "auto"})
    shown = json.loads(out.stdout)["blas"]
    assert shown["kind"] in ("renamed", "system"), shown
    assert shown["load_path"] and shown["load_path"] in shown["line"]


# ---------------------------------------------------------------- the renamed copy is ours and checked (SPEC H5.3)

PRELOAD = "from worker import blas; import json; i = blas.preload(); print(json.dumps([i.kind, i.path, i.line()]))"
HOSTILE_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void ran(void) {
    const char *mark = getenv("MEMVISOR_TEST_HOSTILE_MARK");
    FILE *f = mark ? fopen(mark, "w") : NULL;
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def preload_in_child(cache: Path, mark: Path) -> tuple[str, str, str]:
    """A fresh process's `preload` with `cache` as MEMVISOR_CACHE: (kind, path, its line)."""
    out = subprocess.run([sys.executable, "-c", PRELOAD], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120, env=os.environ | {found.CACHE_ENV: str(cache), found.ENV: "auto",
                                                        "MEMVISOR_TEST_HOSTILE_MARK": str(mark)})
    kind, path, line = json.loads(out.stdout)
    return kind, path, line


@pytest.fixture
def own_copy(tmp_path) -> tuple[Path, Path]:
    """A caches folder of this test's with a renamed copy made by a worker: (the cache, the copy)."""
    cache = tmp_path / "cache"
    kind, path, _ = preload_in_child(cache, tmp_path / "unused")
    assert kind == "renamed"
    return cache, Path(path)


@pytest.fixture(scope="module")
def hostile_library(tmp_path_factory) -> Path:
    """A shared library whose constructor leaves a mark: loaded once, it has run."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library with a constructor")
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "hostile.c").write_text(HOSTILE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(folder / "hostile.so"), str(folder / "hostile.c")], check=True)
    return folder / "hostile.so"


def recorded_sha256(copy: Path) -> str:
    return found.checksum_path(copy).read_text().split()[0]


@linux_only
@pytest.mark.parametrize("how", ["replaced", "no record", "writable by others", "a link"])
def test_h5_a_blas_copy_that_is_not_the_file_written_is_written_again_never_loaded(own_copy, hostile_library,
                                                                                  tmp_path, how):
    cache, copy = own_copy
    if how == "a link":
        copy.unlink()
        copy.symlink_to(hostile_library)
    else:
        shutil.copyfile(hostile_library, tmp_path / "swap")
        os.replace(tmp_path / "swap", copy)  # the bytes of another library, at the copy's name
        if how == "no record":  # as every copy an earlier version made
            found.checksum_path(copy).unlink()
        if how == "writable by others":
            copy.chmod(0o777)
            found.checksum_path(copy).write_text(hashlib.sha256(copy.read_bytes()).hexdigest() + "\n")
    mark = tmp_path / "ran"
    kind, path, line = preload_in_child(cache, mark)
    assert not mark.exists(), "the hostile library's constructor ran"
    assert (kind, path) == ("renamed", str(copy)) and "OpenBLAS" in line
    assert not copy.is_symlink() and stat.S_IMODE(copy.stat().st_mode) == 0o700
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == recorded_sha256(copy)


@linux_only
@pytest.mark.parametrize("how", ["another user's", "others may write", "a link"])
def test_h5_a_blas_folder_not_ours_alone_is_never_loaded_from(own_copy, hostile_library, tmp_path, how):
    cache, copy = own_copy
    blas_dir = copy.parent
    shutil.copyfile(hostile_library, tmp_path / "swap")
    os.replace(tmp_path / "swap", copy)
    found.checksum_path(copy).write_text(hashlib.sha256(copy.read_bytes()).hexdigest() + "\n")  # a matching record
    if how == "another user's":
        try:
            os.chown(blas_dir, 65534, -1)
        except PermissionError:
            pytest.skip("making a folder another user's needs root")
        words = "uid 65534"
    elif how == "others may write":
        blas_dir.chmod(0o777)
        words = "writable by group and others"
    else:
        blas_dir.rename(tmp_path / "elsewhere")
        blas_dir.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        words = "symbolic link"
    mark = tmp_path / "ran"
    kind, _path, line = preload_in_child(cache, mark)
    assert not mark.exists(), "the hostile library's constructor ran"
    assert kind in ("stock", "system") and str(blas_dir) in line and words in line
