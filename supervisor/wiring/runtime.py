"""Where a running supervisor keeps its sockets and state.

Several supervisors can run side by side; each owns one runtime directory and
a client finds the one it means through `--runtime-dir`. The default is private
to the user (mode 0700) so no other account can reach the control socket.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "memvisor"
    return Path(tempfile.gettempdir()) / f"memvisor-{os.getuid()}"


def runtime_dir_problem(path: Path) -> str | None:
    """Why a client cannot look for a supervisor in `path` (it is a file, say), or None.

    Said in words: `status --runtime-dir FILE` printed a NotADirectoryError traceback."""
    if path.exists() and not path.is_dir():
        return f"--runtime-dir {path} is not a folder (a supervisor's runtime dir is one)"
    return None


def ensure_private_dir(path: Path) -> Path:
    """Create `path` with mode 0700, or refuse one another user could enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"runtime directory {path} belongs to another user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(0o700)
    return path
