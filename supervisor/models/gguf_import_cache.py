"""GGUF files as models: the import cache and the importer child process.

Why a child process: importing reads tensors with MLX, and the supervisor
never imports MLX (docs/architecture.md), so `modelfiles.gguf_import` runs as its own
process and reports progress as JSON lines (`shared.gguf.ImportLine`) on its
stdout. `import-gguf` runs it in the foreground; a `[[models]] path` ending
in `.gguf` runs it on the model's first load, before its worker is spawned,
into a cache folder keyed on the file's path, size and modification time, so
later loads (and restarts) reuse the folder and a changed file is imported
afresh.

Why before the spawn rather than inside the worker: the worker then only
ever loads MLX folders, its load timeout keeps meaning "MLX load", no new
wire message is needed for import progress, and the one importer serves both
the command line and the supervisor.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import TaskID

from shared.gguf import (
    ImportDone,
    ImportFailed,
    ImportLine,
    ImportNote,
    ImportProgress,
    decode_import_line,
)

log = logging.getLogger("memvisor.gguf")

IMPORTER_VERSION = 1  # bump when the importer's output changes, so old caches are not reused
ROOT = Path(__file__).resolve().parent.parent
OnLine = Callable[[ImportLine], None]


class GGUFImportError(RuntimeError):
    """The importer failed; the message is its own (it names the field or tensor)."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memvisor" / "gguf"


def cache_folder(gguf: str | Path, root: Path | None = None) -> Path:
    """Where `gguf` is imported to: `<stem>-<hash of path, size, mtime, importer version>`."""
    path = Path(gguf).expanduser().resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{IMPORTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (root or cache_root()) / f"{path.stem}-{digest}"


def is_imported(folder: Path) -> bool:
    """The importer moves config.json in last: its presence means a whole folder."""
    return (folder / "config.json").is_file()


def importer_argv(src: str | Path, dest: str | Path, *, force: bool = False, requantize: int = 0) -> list[str]:
    argv = [sys.executable, "-m", "modelfiles.gguf_import", "--json", str(src), str(dest)]
    argv += ["--requantize", str(requantize)] if requantize else []
    return argv + ["--force"] if force else argv


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _outcome(lines: list[ImportLine], returncode: int, stderr: bytes) -> ImportDone:
    for line in reversed(lines):
        if isinstance(line, ImportDone) and returncode == 0:
            return line
        if isinstance(line, ImportFailed):
            raise GGUFImportError(line.error)
    tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
    raise GGUFImportError(f"the importer exited with status {returncode}: " + " | ".join(tail))


def run_import(src: str | Path, dest: str | Path, on_line: OnLine, *, force: bool = False,
               requantize: int = 0) -> ImportDone:
    """Run the importer in the foreground, passing each progress line to `on_line`."""
    import subprocess

    lines: list[ImportLine] = []
    with subprocess.Popen(importer_argv(src, dest, force=force, requantize=requantize), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=_child_env()) as child:
        assert child.stdout is not None and child.stderr is not None
        for raw in child.stdout:
            line = decode_import_line(raw)
            if line is not None:
                lines.append(line)
                on_line(line)
        stderr = child.stderr.read()
    return _outcome(lines, child.returncode, stderr)


async def run_import_async(src: str | Path, dest: str | Path, on_line: OnLine) -> ImportDone:
    """As `run_import`, without blocking the supervisor's loop; cancelling kills the child."""
    child = await asyncio.create_subprocess_exec(
        *importer_argv(src, dest, force=True), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_child_env())
    assert child.stdout is not None and child.stderr is not None
    lines: list[ImportLine] = []
    try:
        stderr_task = asyncio.ensure_future(child.stderr.read())
        async for raw in child.stdout:
            line = decode_import_line(raw)
            if line is not None:
                lines.append(line)
                on_line(line)
        stderr = await stderr_task
        await child.wait()
    except BaseException:
        if child.returncode is None:
            child.kill()
            await child.wait()
        raise
    return _outcome(lines, child.returncode or 0, stderr)


class ProgressLog:
    """Import progress as log lines, at most one every `every` seconds, plus every note."""

    def __init__(self, label: str, every: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.label = label
        self.every = every
        self.clock = clock
        self._last = -every

    def __call__(self, line: ImportLine) -> None:
        match line:
            case ImportProgress(phase=phase, done=done, total=total):
                now = self.clock()
                if now - self._last >= self.every or done >= total:
                    self._last = now
                    log.info("importing %s: %s %d%%", self.label, phase, 100 * done // max(1, total))
            case ImportNote(text=text):
                log.warning("importing %s: %s", self.label, text)
            case ImportDone() | ImportFailed():
                pass


async def ensure_imported(gguf: str | Path, on_line: OnLine | None = None,
                          root: Path | None = None) -> Path:
    """The MLX folder for `gguf`, importing it first when the cache has none."""
    gguf = Path(gguf).expanduser()
    try:
        folder = cache_folder(gguf, root)
    except OSError as exc:
        raise GGUFImportError(f"cannot read {gguf}: {exc.strerror or exc}") from None
    if is_imported(folder):
        return folder
    log.info("Importing %s into %s (first load of this file)", gguf, folder)
    reporter = on_line or progress_reporter(f"importing {Path(gguf).name}")
    try:
        done = await run_import_async(gguf, folder, reporter)
    finally:
        if isinstance(reporter, TerminalBar):
            reporter.close()
    log.info("Imported %s in %.1f s", gguf, done.seconds)
    return folder


class TerminalBar:
    """Import progress as a rich progress bar (for a terminal), notes printed above it."""

    def __init__(self, label: str):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn(f"[bold]{label}[/] {{task.description}}"), BarColumn(),
                            DownloadColumn(), TimeRemainingColumn(), transient=True)
        self.task: TaskID | None = None

    def __call__(self, line: ImportLine) -> None:
        match line:
            case ImportProgress(phase=phase, done=done, total=total):
                if self.task is None:
                    self.bar.start()
                    self.task = self.bar.add_task(phase, total=total)
                self.bar.update(self.task, description=phase, completed=done, total=total)
            case ImportNote(text=text):
                self.bar.console.print(f"note: {text}")
            case ImportDone() | ImportFailed():
                self.close()

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()
            self.task = None


def progress_reporter(label: str) -> OnLine:
    """A bar on a terminal, log lines otherwise (a service's log, a test's pipe)."""
    return TerminalBar(label) if sys.stderr.isatty() else ProgressLog(label)
