"""Load OpenBLAS into a Linux worker before MLX, so MLX's matmuls run at the CPU's pace.

MLX's Linux CPU wheel links netlib's reference BLAS (float32 matmul ~2 GFLOP/s).
libmlx.so asks for the plain, unversioned names (`cblas_sgemm`, `sgesdd_` ...),
and the dynamic linker looks a name up in the process's global scope before a
library's own dependencies: a BLAS opened with RTLD_GLOBAL *before* `import
mlx.core` is what libmlx binds to, with no LD_PRELOAD and no re-exec.
`shared.probe.blas_plan` says which library that is (so `probe` can tell it without
loading anything); this module makes the renamed copy when one is needed,
opens the library, sets its thread count and logs one line saying what the
worker uses. Nothing here ever stops a worker: a failure logs a warning and
the worker goes on with MLX's own BLAS, only slower.

Threads: OpenBLAS gets one thread fewer than the CPUs of the worker's
affinity mask (at least one) unless OPENBLAS_NUM_THREADS is set. MLX runs one
op at a time on its CPU stream and waits inside sgemm, so within a worker the
two do not compete; but a gemm split over every CPU waits for its slowest
part, and any other busy process (the supervisor streaming tokens, another
worker's step) makes that part slow: on the 2-core CI-class machine, shared,
1 thread beat 2 in every run (one process 12.7 vs 9.5 GFLOP/s, two at once
15.8 vs 13.0 together; scripts/bench_blas.py). One CPU is left to the rest;
on a many-core machine that costs one thread in many. Several workers
prefilling at once still share the cores: OPENBLAS_NUM_THREADS=1 is the
setting for a machine that serves many busy float32 models at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from shared import private_files
from shared.probe import blas_plan as found

log = logging.getLogger("memvisor.worker.blas")

SONAME = "libmemvisor_openblas.so"   # the renamed copy's own name, so it never passes for the package's


class BlasInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What this process's MLX computes with (the worker's hello carries `line()`)."""

    kind: found.BlasKind
    path: str = ""
    config: str = ""     # openblas_get_config(): version, DYNAMIC_ARCH, the core it picked
    threads: int = 0
    origin: str = ""
    warning: str = ""    # what failed on the way: why it is stock, or why the system's and not the package's

    def line(self) -> str:
        if self.kind == "stock":
            return (self.origin or "MLX's bundled BLAS") + (f" ({self.warning})" if self.warning else "")
        threads = f"{self.threads} thread" + ("" if self.threads == 1 else "s")
        warned = f"; {self.warning}" if self.warning else ""
        return f"{self.config or 'BLAS'}, {threads}, {self.path} ({self.origin}){warned}"


_info: BlasInfo | None = None
_handle: ctypes.CDLL | None = None   # held for the process's life: closing it would unbind MLX


def in_use() -> BlasInfo | None:
    """What `preload` loaded in this process, None before it ran."""
    return _info


def share_copy(root: Path, copy: Path | None = None) -> bool:
    """Give the caches folder `root` a verified BLAS copy: a private `blas/` of hard links to
    `copy` (default: the one this process verified and loaded) and its recorded sha256, or
    copies across filesystems; a worker under `MEMVISOR_CACHE=root` verifies them as it would
    its own. For the tests' and the scripts' throwaway cache roots: a linked folder is refused
    (SPEC H5.3), and a fresh copy per root would cost each a patchelf run. False when there is
    no copy to share."""
    if copy is None:
        info = in_use()
        if info is None or info.kind != "renamed":
            return False
        copy = Path(info.path)
    folder = root / "blas"
    if folder.exists():
        return True
    folder.mkdir(mode=0o700, parents=True)
    for source in (copy, found.checksum_path(copy)):
        try:
            os.link(source, folder / source.name)
        except OSError:
            shutil.copyfile(source, folder / source.name)
            os.chmod(folder / source.name, 0o600)
    return True


def preload() -> BlasInfo:
    """Open the fast BLAS with RTLD_GLOBAL; call before the first `import mlx.core`. Idempotent."""
    global _info
    if _info is None:
        _info = _preload()
        if _info.warning:
            log.warning("BLAS: %s", _info.line())
        else:
            log.info("BLAS: %s", _info.line())
    return _info


def _preload() -> BlasInfo:
    if not found.applies():
        return BlasInfo(kind="stock", origin="MLX's own (Accelerate on macOS)")
    if "mlx.core" in sys.modules:
        return BlasInfo(kind="stock", warning="mlx.core was imported before worker.blas.preload(); "
                                              "its BLAS is already bound")
    plan = found.plan()
    if plan.kind == "stock":
        return BlasInfo(kind="stock", warning="" if found.stock_chosen() else plan.reason)
    try:
        return _load(plan)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        failed = str(exc) if plan.load_path in str(exc) else f"{plan.load_path}: {exc}"
    system = found.system_library() if plan.kind == "renamed" else None
    if system is not None:
        try:
            info = _open(found.BlasPlan(kind="system", source=str(system), load_path=str(system),
                                        origin="the system"))
            return msgspec.structs.replace(info, warning=f"{plan.describe()} failed: {failed}")
        except OSError as exc:
            failed += f"; {system}: {exc}"
    return BlasInfo(kind="stock", warning=f"could not load a fast BLAS: {failed}")


def _load(plan: found.BlasPlan) -> BlasInfo:
    """The plan's library opened; the renamed copy only once verified (SPEC H5.3), and written
    (again) when it is missing or is not the file we wrote. A refused folder raises NotPrivate."""
    if plan.kind != "renamed":
        return _open(plan)
    if plan.ready:
        try:
            return _open_copy(plan)
        except found.CopyChanged as exc:
            log.warning("BLAS: %s; writing the copy again", exc)
    make_renamed_copy(Path(plan.source), Path(plan.load_path))
    return _open_copy(plan)


def _open_copy(plan: found.BlasPlan) -> BlasInfo:
    """The verified copy, loaded through the very descriptor that was checked (by its path where
    /proc is not mounted: the folder is ours alone, so only this user could swap it meanwhile)."""
    with found.open_verified_copy(Path(plan.load_path)) as handle:
        return _open(plan, private_files.descriptor_path(handle.fileno()) or plan.load_path)


def _threads() -> int:
    """OPENBLAS_NUM_THREADS when the user set it, else one fewer than the CPUs this process may use."""
    try:
        return max(1, int(os.environ["OPENBLAS_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, len(os.sched_getaffinity(0)) - 1)


def _open(plan: found.BlasPlan, target: str = "") -> BlasInfo:
    """`target` (default the plan's path) opened into the global scope, its threads set."""
    global _handle
    threads = _threads()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(threads))  # read by OpenBLAS as it loads
    handle = ctypes.CDLL(target or plan.load_path, mode=ctypes.RTLD_GLOBAL)
    if not hasattr(handle, "cblas_sgemm"):
        raise OSError("exports no cblas_sgemm (a prefixed or BLAS-less library)")
    config = ""
    if hasattr(handle, "openblas_get_config"):
        handle.openblas_get_config.restype = ctypes.c_char_p
        config = (handle.openblas_get_config() or b"").decode(errors="replace").strip()
    if hasattr(handle, "openblas_set_num_threads"):
        handle.openblas_set_num_threads(threads)
    if hasattr(handle, "openblas_get_num_threads"):
        threads = int(handle.openblas_get_num_threads())
    _handle = handle
    return BlasInfo(kind=plan.kind, path=plan.load_path, config=config, threads=threads, origin=plan.origin)


def make_renamed_copy(source: Path, dest: Path, prefix: str = found.PREFIX) -> None:
    """Write `source` to `dest` with every dynamic name `scipy_x` renamed `x` (patchelf).

    Made once per package version into the user cache, through a temporary
    file and a rename, so workers starting together never see half a file;
    the sha256 of what was written goes beside it (`NAME.sha256`), and a worker
    loads the copy only when it still matches (found.open_verified_copy).
    """
    patchelf = found.patchelf_binary()
    if patchelf is None:
        raise OSError("no patchelf (a Linux dependency of memvisor) to rename the library's names")
    names = [n for n in dynamic_names(source) if n.startswith(prefix)]
    if not names:
        raise ValueError(f"{source} has no {prefix!r} names to rename")
    if dest.parent == found.cache_dir():
        found.blas_folder(create=True)  # the caches folder and blas/ made or checked ours alone (NotPrivate)
    private_files.private_folder(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:  # 0700, ours
        mapping = Path(tmp) / "names.map"
        mapping.write_text("".join(f"{n} {n[len(prefix):]}\n" for n in names))
        out = Path(tmp) / dest.name
        done = subprocess.run([patchelf, "--rename-dynamic-symbols", str(mapping), "--set-soname", SONAME,
                               "--output", str(out), str(source)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(f"{patchelf} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.chmod(out, 0o700)
        with open(out, "rb") as written:
            digest = found.sha256_of(written)
        record = Path(tmp) / found.checksum_path(dest).name
        private_files.write_private(record, f"{digest}  {dest.name}\n".encode())
        os.replace(record, found.checksum_path(dest))
        os.replace(out, dest)
    log.info("BLAS: renamed %d names of %s into %s (sha256 %s)", len(names), source, dest, digest[:16])


def dynamic_names(path: Path) -> list[str]:
    """The names a 64-bit little-endian ELF library defines in .dynsym (no binutils needed)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strtab_offset = sections[link][4]
        for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            st_name, _st_info, _other, shndx = struct.unpack_from("<IBBH", data, at)
            if shndx == 0:  # undefined here
                continue
            end = data.index(b"\0", strtab_offset + st_name)
            names.append(data[strtab_offset + st_name:end].decode())
    return names
