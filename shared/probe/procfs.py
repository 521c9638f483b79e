"""Reading /proc and cgroup files: descriptors kept open, and the parsers.

Split from the probe (`shared.probe.linux`) so that what the kernel's text
says can be read, and tested, apart from how the probe uses it: bytes in,
typed values out, no policy. Why the files are re-read with `pread` and
searched with `find` is in `shared.probe.linux`'s docstring.
"""

from __future__ import annotations

import os

import msgspec

from shared.probe.base import ProbeError, Psi, PsiLine

# A cgroup "limit" this large means none: v1 writes PAGE_COUNTER_MAX pages
# (0x7FFFFFFFFFFFF000 on 4 KiB pages), v2 writes "max".
UNLIMITED = 1 << 62

_READ_SIZE = 8192


# ---------------------------------------------------------------------------
# Files kept open and re-read in place.


class ProcFile:
    """A /proc or /sys file opened once and re-read with `pread` at 0."""

    __slots__ = ("path", "_fd", "_size")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._size = _READ_SIZE

    def read(self) -> bytes:
        """The whole file; ProbeError naming the path when it cannot be read."""
        for attempt in (0, 1):
            try:
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                return self._read_all()
            except OSError as exc:
                self.close()
                if attempt or exc.errno not in _REOPEN_ERRNOS:
                    raise ProbeError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        raise AssertionError("unreachable")

    def _read_all(self) -> bytes:
        while True:
            data = os.pread(self._fd, self._size, 0)
            if len(data) < self._size:
                return data
            self._size *= 2  # the text outgrew the buffer: read it whole

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1


# A stale descriptor (file replaced, cgroup re-created) is worth one reopen.
_REOPEN_ERRNOS = frozenset({9, 19, 22})  # EBADF, ENODEV, EINVAL


def read_once(path: str) -> bytes:
    """Read a file that is only read on the slow path (no descriptor kept)."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ProbeError(f"cannot read {path}: {exc.strerror or exc}") from None


def under(root: str, path: str) -> str:
    """`path` inside `root`, the directory the probe reads as /."""
    return os.path.join(root, path.lstrip("/"))


# ---------------------------------------------------------------------------
# Parsers: bytes in, typed values out. A field counts only when its line is
# complete (ends in a newline), so a truncated file cannot yield a short
# number that looks valid.


def _line_value(data: bytes, key: bytes) -> bytes | None:
    """The rest of the line that starts with `key` (key includes its separator)."""
    if data.startswith(key):
        start = len(key)
    else:
        i = data.find(b"\n" + key)
        if i < 0:
            return None
        start = i + 1 + len(key)
    end = data.find(b"\n", start)
    if end < 0:
        return None
    return data[start:end]


def _whole(text: bytes | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 0 else None


def meminfo_field(data: bytes, name: bytes) -> int | None:
    """One /proc/meminfo field in bytes (`kB` lines) or as a bare count."""
    rest = _line_value(data, name + b":")
    if rest is None:
        return None
    parts = rest.split()
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[1] != b"kB"):
        return None
    value = _whole(parts[0])
    if value is None:
        return None
    return value * 1024 if len(parts) == 2 else value


class Meminfo(msgspec.Struct, frozen=True, kw_only=True):
    """The /proc/meminfo fields the guard uses, in bytes; None when absent."""

    total: int | None = None
    free: int | None = None
    available: int | None = None
    active_anon: int | None = None
    inactive_anon: int | None = None
    active_file: int | None = None
    inactive_file: int | None = None
    shmem: int | None = None
    unevictable: int | None = None
    swap_total: int | None = None
    swap_free: int | None = None


def _meminfo_keys(*names: tuple[str, str]) -> tuple[tuple[bytes, str], ...]:
    return tuple((b"\n" + key.encode() + b":", attr) for attr, key in names)


# The tick reads only what the counters need; `probe` reads the rest too.
TICK_FIELDS = _meminfo_keys(
    ("total", "MemTotal"), ("free", "MemFree"), ("available", "MemAvailable"),
    ("active_anon", "Active(anon)"), ("active_file", "Active(file)"),
    ("inactive_file", "Inactive(file)"), ("swap_total", "SwapTotal"),
)
ALL_FIELDS = TICK_FIELDS + _meminfo_keys(
    ("inactive_anon", "Inactive(anon)"), ("shmem", "Shmem"),
    ("unevictable", "Unevictable"), ("swap_free", "SwapFree"),
)


def parse_meminfo(data: bytes, fields: tuple[tuple[bytes, str], ...] = ALL_FIELDS) -> Meminfo:
    """The named /proc/meminfo fields, in bytes.

    One flat loop of `find`s (this runs every tick): a field is kept only
    when its line is complete and reads `<number> kB`; anything else --
    missing, truncated, garbage, negative -- leaves it None.
    """
    data = b"\n" + data
    found: dict[str, int] = {}
    for key, attr in fields:
        i = data.find(key)
        if i < 0:
            continue
        start = i + len(key)
        end = data.find(b"\n", start)
        if end < 0:
            continue
        parts = data[start:end].split()
        if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
            continue
        found[attr] = int(parts[0]) * 1024
    return Meminfo(**found)


class CgroupStat(msgspec.Struct, frozen=True, kw_only=True):
    """A cgroup's memory.stat (whole subtree), in bytes; None when absent."""

    anon: int | None = None
    file: int | None = None
    shmem: int | None = None
    active_anon: int | None = None
    inactive_anon: int | None = None
    active_file: int | None = None
    inactive_file: int | None = None
    hierarchical_limit: int | None = None   # v1 only: the limit over all ancestors


# attribute -> (v2 key, v1 key). v1 `total_*` keys include the subtree.
_STAT_KEYS = {
    "anon": (b"anon", b"total_rss"),
    "file": (b"file", b"total_cache"),
    "shmem": (b"shmem", b"total_shmem"),
    "active_anon": (b"active_anon", b"total_active_anon"),
    "inactive_anon": (b"inactive_anon", b"total_inactive_anon"),
    "active_file": (b"active_file", b"total_active_file"),
    "inactive_file": (b"inactive_file", b"total_inactive_file"),
}


def parse_cgroup_stat(data: bytes, version: int) -> CgroupStat:
    values: dict[str, int | None] = {}
    for attr, (v2_key, v1_key) in _STAT_KEYS.items():
        if version == 2:
            values[attr] = _whole(_line_value(data, v2_key + b" "))
        else:
            value = _whole(_line_value(data, v1_key + b" "))
            if value is None:  # a v1 cgroup without hierarchy: the plain key
                value = _whole(_line_value(data, v1_key[len(b"total_"):] + b" "))
            values[attr] = value
    if version == 1:
        values["hierarchical_limit"] = _whole(_line_value(data, b"hierarchical_memory_limit "))
    return CgroupStat(**values)


def parse_limit(data: bytes, path: str = "limit") -> int | None:
    """A cgroup limit file: bytes, or None for "max" / a no-limit sentinel."""
    text = data.strip()
    if text == b"max":
        return None
    value = _whole(text)
    if value is None or not data.endswith(b"\n"):
        raise ProbeError(f"{path} is not a byte count: {data[:40]!r}")
    return None if value >= UNLIMITED else value


def parse_counter(data: bytes, path: str = "counter") -> int:
    value = _whole(data.strip())
    if value is None or not data.endswith(b"\n"):
        raise ProbeError(f"{path} is not a byte count: {data[:40]!r}")
    return value


def _psi_line(rest: bytes) -> PsiLine:
    fields = dict(part.split(b"=", 1) for part in rest.split())
    return PsiLine(
        avg10=float(fields[b"avg10"]), avg60=float(fields[b"avg60"]),
        avg300=float(fields[b"avg300"]), total_us=int(fields[b"total"]),
    )


def parse_psi(data: bytes, source: str = "") -> Psi:
    """A PSI file (`some ...` and usually `full ...`)."""
    try:
        some = _line_value(data, b"some ")
        if some is None:
            raise ValueError("no complete `some` line")
        full = _line_value(data, b"full ")
        return Psi(
            some=_psi_line(some), full=None if full is None else _psi_line(full), source=source
        )
    except (ValueError, KeyError) as exc:
        raise ProbeError(f"{source or 'PSI'} is not a pressure-stall file: {exc}") from None


def parse_statm(data: bytes, page_size: int) -> int | None:
    """Anonymous resident bytes from /proc/PID/statm (resident - shared).

    None for a process without memory (a zombie reads all zeros).
    """
    parts = data.split()
    if len(parts) < 3 or not data.endswith(b"\n"):
        return None
    resident, shared = _whole(parts[1]), _whole(parts[2])
    if resident is None or shared is None or resident == 0:
        return None
    return max(0, resident - shared) * page_size


def parse_smaps_rollup(data: bytes) -> int | None:
    """USS: Private_Clean + Private_Dirty + Private_Hugetlb; None if unreadable."""
    clean = meminfo_field(data, b"Private_Clean")
    dirty = meminfo_field(data, b"Private_Dirty")
    if clean is None or dirty is None:
        return None
    return clean + dirty + (meminfo_field(data, b"Private_Hugetlb") or 0)
