"""Models found in folders (`serve --models-dir`, `[supervisor] models_dirs`).

A user with a folder of models, or a Hugging Face cache, should not have to
list each one by path. Each MLX model folder (a `config.json` beside
`model*.safetensors`) and each `.gguf` file under a models folder becomes a
model whose id is its folder (or file) name; the Hugging Face cache layout
`models--org--name/snapshots/<revision>/` becomes `org/name`, at the revision
`refs/main` points to (else the newest snapshot). Entries of the config file
win over discovered ones with the same id.

The scan is bounded (depth and count) so a models folder pointed at a home
directory cannot stall the start; what it skips is said in a warning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from supervisor.config import Config

MAX_DEPTH = 4
MAX_MODELS = 1000
_HF_DIR = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")
_SKIP = {".git", "__pycache__", ".cache", "node_modules"}


class Found(msgspec.Struct, frozen=True, kw_only=True):
    """One discovered model: its id and where it lives."""

    id: str
    path: str


def is_mlx_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors"))


def _hf_snapshot(repo: Path) -> Path | None:
    """The snapshot `refs/main` names, else the most recently changed one."""
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        chosen = snapshots / ref.read_text().strip()
        if chosen.is_dir():
            return chosen
    candidates = [d for d in snapshots.iterdir() if d.is_dir()] if snapshots.is_dir() else []
    return max(candidates, key=lambda d: d.stat().st_mtime, default=None)


def scan(root: Path, warnings: list[str]) -> list[Found]:
    """Every model under `root` (breadth first, bounded)."""
    found: list[Found] = []
    if not root.is_dir():
        warnings.append(f"models folder {root} does not exist or is not a folder")
        return found
    level = [root]
    for depth in range(MAX_DEPTH + 1):
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(folder.iterdir())
            except OSError as exc:
                warnings.append(f"cannot read {folder}: {exc.strerror or exc}")
                continue
            for entry in entries:
                if entry.name in _SKIP or entry.name.startswith("."):
                    continue
                model = _model_at(entry, root)
                if model is not None:
                    found.append(model)
                elif entry.is_dir() and depth < MAX_DEPTH:
                    below.append(entry)
                if len(found) >= MAX_MODELS:
                    warnings.append(f"stopped scanning {root} after {MAX_MODELS} models")
                    return found
        level = below
    return found


def _model_at(entry: Path, root: Path) -> Found | None:
    if entry.is_file() and entry.suffix == ".gguf":
        return Found(id=entry.stem, path=str(entry))
    if not entry.is_dir():
        return None
    hf = _HF_DIR.match(entry.name)
    if hf is not None:
        snapshot = _hf_snapshot(entry)
        if snapshot is not None and is_mlx_model_dir(snapshot):
            return Found(id=f"{hf['org']}/{hf['name']}", path=str(snapshot))
        return None
    if is_mlx_model_dir(entry):
        return Found(id=entry.name, path=str(entry))
    return None


def discover(dirs: list[str], known: set[str]) -> tuple[list[Found], list[str]]:
    """Models in `dirs` whose id is not in `known` (config entries win); plus warnings.

    Two folders offering the same id: the first one scanned keeps it.
    """
    warnings: list[str] = []
    taken = set(known)
    out: list[Found] = []
    for folder in dirs:
        for model in scan(Path(folder).expanduser(), warnings):
            if model.id in taken:
                continue
            taken.add(model.id)
            out.append(model)
    return out, warnings


def with_discovered(config: Config) -> tuple[Config, list[str]]:
    """`config` plus the models its `models_dirs` hold (config entries win)."""
    from supervisor.config import ModelConfig

    dirs = config.supervisor.models_dirs
    if not dirs:
        return config, []
    found, warnings = discover(dirs, config.names())
    models = [*config.models, *(ModelConfig(id=f.id, path=f.path) for f in found)]
    return msgspec.structs.replace(config, models=models), warnings
