"""Where this process's memory cgroup is, and the limit that binds it.

Split from the probe (`shared.probe.linux`): finding the cgroup walks
mountinfo and /proc/self/cgroup and reads every limit on the path, which
is the slow path, run every `slow_interval` seconds, never on the tick.
How a container's numbers feed SPEC C2 is in `shared.probe.linux`.
"""

from __future__ import annotations

import os
import re

import msgspec

from shared.probe.base import ProbeError
from shared.probe.procfs import parse_limit, read_once, under

# ---------------------------------------------------------------------------
# Where the process's memory cgroup is.


class Mount(msgspec.Struct, frozen=True):
    root: str         # the cgroup path mounted (field 4 of mountinfo)
    mountpoint: str
    fstype: str
    options: tuple[str, ...]


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo (slow path)."""
    if "\\" not in field:
        return field
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(data: bytes) -> list[Mount]:
    """The cgroup mounts of /proc/self/mountinfo (others are not needed)."""
    mounts = []
    for line in data.decode(errors="replace").splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            continue
        fstype = fields[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mounts.append(Mount(
            root=_unescape(fields[3]), mountpoint=_unescape(fields[4]),
            fstype=fstype, options=tuple(fields[sep + 3].split(",")),
        ))
    return mounts


class Membership(msgspec.Struct, frozen=True):
    v1_memory: str | None = None   # the path in the v1 memory hierarchy
    v2: str | None = None          # the path in the unified hierarchy


def parse_proc_cgroup(data: bytes) -> Membership:
    v1 = v2 = None
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return Membership(v1_memory=v1, v2=v2)


class CgroupPlace(msgspec.Struct, frozen=True):
    """The process's memory cgroup: its version and the directories from the
    process's own cgroup up to the top of the mount (the limits that apply)."""

    version: int
    dirs: tuple[str, ...]


def locate_cgroup(root: str = "/") -> CgroupPlace | None:
    """Find the memory cgroup of this process, or None when there is none.

    A v1 memory controller wins over v2 (in a hybrid layout the unified
    hierarchy carries no memory controller). Inside a cgroup namespace the
    process sees itself at "/" of a mount whose root is its own cgroup.
    """
    member = parse_proc_cgroup(read_once(under(root, "proc/self/cgroup")))
    mounts = parse_mountinfo(read_once(under(root, "proc/self/mountinfo")))
    if member.v1_memory is not None:
        version, path = 1, member.v1_memory
        candidates = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.options]
    elif member.v2 is not None:
        version, path = 2, member.v2
        candidates = [m for m in mounts if m.fstype == "cgroup2"]
    else:
        return None
    if not candidates:
        return None
    mount = candidates[0]
    rel = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
        rel = path[len(mount.root):]
    top = under(root, mount.mountpoint)
    leaf = os.path.normpath(os.path.join(top, rel.lstrip("/")))
    if not (leaf == top or leaf.startswith(top.rstrip("/") + "/")) or not os.path.isdir(leaf):
        leaf = top  # the path is outside this mount (namespaced): the mount is ours
    dirs = [leaf]
    while dirs[-1] != top:
        dirs.append(os.path.dirname(dirs[-1]))
    return CgroupPlace(version=version, dirs=tuple(dirs))


# ---------------------------------------------------------------------------
# The container limit (slow path).


class Container(msgspec.Struct, frozen=True, kw_only=True):
    """The cgroup whose limit binds, as found on the last slow refresh."""

    version: int
    dir: str
    limit: int | None         # None: no finite limit anywhere on the path
    limit_source: str
    swap_allowed: bool | None  # None: the cgroup does not say


def _limit_files(version: int) -> tuple[str, ...]:
    return ("memory.max", "memory.high") if version == 2 else ("memory.limit_in_bytes",)


def _smallest_limit(place: CgroupPlace) -> tuple[int | None, str, str]:
    """(limit, its file, its cgroup dir) -- the smallest finite limit on the path."""
    best: tuple[int | None, str, str] = (None, "", place.dirs[0])
    for directory in place.dirs:
        for name in _limit_files(place.version):
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                continue
            limit = parse_limit(read_once(path), path)
            if limit is not None and (best[0] is None or limit < best[0]):
                best = (limit, path, directory)
    return best


def _swap_allowed(version: int, directory: str, limit: int | None) -> bool | None:
    """Whether the binding cgroup may swap at all (T3 inside a container)."""
    try:
        if version == 2:
            path = os.path.join(directory, "memory.swap.max")
            if not os.path.exists(path):
                return None
            swap = parse_limit(read_once(path), path)
            return swap is None or swap > 0
        path = os.path.join(directory, "memory.memsw.limit_in_bytes")
        if not os.path.exists(path) or limit is None:
            return None
        memsw = parse_limit(read_once(path), path)
        return memsw is None or memsw > limit
    except ProbeError:
        return None


def find_container(root: str = "/") -> Container | None:
    place = locate_cgroup(root)
    if place is None:
        return None
    limit, source, directory = _smallest_limit(place)
    return Container(
        version=place.version, dir=directory, limit=limit, limit_source=source,
        swap_allowed=_swap_allowed(place.version, directory, limit),
    )
