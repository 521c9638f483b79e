"""Models found in folders (`serve --models-dir`, `[supervisor] models_dirs`).

A user with a folder of models, or a Hugging Face cache, should not have to
list each one by path. Each MLX model folder (a `config.json` beside
`model*.safetensors`) and each `.gguf` file under a models folder becomes a
model whose id is its folder (or file) name; the Hugging Face cache layout
`models--org--name/snapshots/<revision>/` becomes `org/name`, at the revision
`refs/main` points to (else the newest snapshot). Entries of the config file
win over discovered ones with the same id. The models `pull` fetched from the hub
(supervisor.models.pulled) are added the same way, before the folders are scanned.

The scan is bounded (depth, models and entries looked at) so a models folder
pointed at a home directory cannot stall the start; what it skips is said in a
warning. A reload runs it on a worker thread, never on the supervisor's loop
(a rescan of 150,000 folders would stall it). A folder name that is not a usable model id (`My Model (4bit)`)
is served under a sanitised id (`My-Model-4bit`), said in a warning, or
skipped with a warning when even that is not usable; it never stops `serve`.

A model whose files are refused (a models folder is input: a named pipe as model.safetensors,
a sparse GGUF or one claiming 2**40 keys, a 1 GiB config.json) is not a model:
it is skipped with a warning, and its id and the reason are kept
(`last_refused`) so the supervisor says so in a `refused` event and a request
for it is a 404 naming why, instead of a load that fails as if it were our bug.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared.gguf import is_gguf_path
from shared.modelinfo import FileRefused, config_refusal, read_small
from shared.weights import WeightsError, estimate_weight_bytes

if TYPE_CHECKING:
    from supervisor.config import Config

MAX_DEPTH = 4
MAX_MODELS = 1000
MAX_ENTRIES = 100_000  # folder entries looked at, all levels together
REF_MAX_BYTES = 4096  # refs/main holds one commit hash
_HF_DIR = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")
_SKIP = {".git", "__pycache__", ".cache", "node_modules"}

_refused_lock = threading.Lock()
_last_refused: dict[str, tuple[str, str]] = {}  # id -> (path, why), from the last with_discovered


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
    try:
        name = read_small(ref, REF_MAX_BYTES).decode("utf-8", "replace").strip()
    except OSError:  # missing, a pipe, too large: fall back to the newest snapshot
        name = ""
    if name and "/" not in name and name not in (".", ".."):
        chosen = snapshots / name
        if chosen.is_dir():
            return chosen
    candidates = [d for d in snapshots.iterdir() if d.is_dir()] if snapshots.is_dir() else []
    return max(candidates, key=lambda d: d.stat().st_mtime, default=None)


def folder_problem(folder: str) -> str | None:
    """Why `folder` cannot be a models folder (missing, not a folder, unreadable), or None.

    Checked when serving starts and at each reload (serve.build_config): a typo in
    `--models-dir` used to serve zero models with a warning; now it stops the start, and a
    reload naming such a folder is refused with the running config kept."""
    path = Path(folder).expanduser()
    try:
        if not path.is_dir():
            return f"{folder}: no such folder" if not path.exists() else f"{folder}: not a folder"
        with os.scandir(path) as entries:
            next(entries, None)
    except OSError as exc:
        return f"{folder}: cannot read it: {exc.strerror or exc}"
    return None


def scan(root: Path, warnings: list[str]) -> list[Found]:
    """Every model under `root` (breadth first, bounded)."""
    found: list[Found] = []
    if not root.is_dir():
        warnings.append(f"models folder {root} does not exist or is not a folder")
        return found
    level = [root]
    seen = 0
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
                seen += 1
                if seen > MAX_ENTRIES:
                    warnings.append(f"stopped scanning {root} after {MAX_ENTRIES} entries")
                    return found
                try:
                    model = _model_at(entry, warnings)
                except OSError as exc:  # vanished, unreadable: the rest of the folder still counts
                    warnings.append(f"cannot read {entry}: {exc.strerror or exc}")
                    continue
                if model is not None:
                    found.append(model)
                elif entry.is_dir() and depth < MAX_DEPTH:
                    below.append(entry)
                if len(found) >= MAX_MODELS:
                    warnings.append(f"stopped scanning {root} after {MAX_MODELS} models")
                    return found
        level = below
    return found


def _model_at(entry: Path, warnings: list[str]) -> Found | None:
    if entry.suffix == ".gguf" and entry.is_file():
        return _found(entry.stem, entry, entry, warnings)
    if not entry.is_dir():
        return None
    hf = _HF_DIR.match(entry.name)
    if hf is not None:
        snapshot = _hf_snapshot(entry)
        if snapshot is not None and is_mlx_model_dir(snapshot):
            return _found(f"{_sanitise(hf['org'])}/{_sanitise(hf['name'])}", entry, snapshot, warnings,
                          named=f"{hf['org']}/{hf['name']}")
        return None
    if is_mlx_model_dir(entry):
        return _found(entry.name, entry, entry, warnings)
    return None


_NOT_ID = re.compile(r"[^A-Za-z0-9._:@+-]+")


def _sanitise(name: str) -> str:
    """Runs of characters a model id cannot hold become one `-`; what cannot start or end one goes."""
    return _NOT_ID.sub("-", name).strip("-._:@+")


def _found(name: str, entry: Path, path: Path, warnings: list[str], named: str = "") -> Found | None:
    """A model under `name` when it is a usable id; else under its sanitised form, said
    in a warning; else nothing, said in a warning (a bad folder name must neither stop
    `serve` with a traceback nor silently drop a reload)."""
    from supervisor.config_checks import check_model_id

    model_id = name if "/" in name else _sanitise(name)
    original = named or name
    problem = check_model_id(model_id)
    if problem is not None:
        warnings.append(f"{entry}: skipped, its name {original!r} gives no usable model id ({problem})")
        return None
    if model_id != original:
        warnings.append(f"{entry}: {original!r} is not a usable model id; served as {model_id!r}")
    return Found(id=model_id, path=str(path))


def refusal(path: str) -> str | None:
    """Why the model files at `path` cannot be a model, or None when they can.

    Bounded reads only (shared.modelinfo, shared.weights, shared.gguf): the
    config.json (a regular file of at most a few MB, a JSON object) and every
    weight file's header, which must declare some tensor data. The estimate read here is remembered, so the first
    load does not read the headers again. A passing failure (EMFILE) is raised."""
    if not is_gguf_path(path):
        why = config_refusal(path)
        if why is not None:
            return why
    try:
        size = estimate_weight_bytes(path)
    except (WeightsError, FileRefused) as exc:
        return str(exc)
    if size == 0:  # a header and gigabytes of nothing: there is nothing to load
        return f"{path}: its weight files declare no tensor data; refused"
    return None


def same_file_key(path: str) -> str:
    """What identifies a model's files whatever path names them (`~`, `..`, a link): its real path."""
    try:
        return os.path.realpath(Path(path).expanduser())
    except (OSError, ValueError):
        return path


def discover(dirs: list[str], known: set[str],
             refused: dict[str, tuple[str, str]] | None = None,
             known_paths: set[str] | frozenset[str] = frozenset()) -> tuple[list[Found], list[str]]:
    """Models in `dirs` whose id is not in `known` and whose files are not in `known_paths`
    (`same_file_key`s: config entries win, by id and by file); plus warnings.

    One model file is one listing: a GGUF that is a [[models]] entry under one id and lies
    in a models folder under its file name is served once, as the entry says. Two folders
    offering the same id: the first one scanned keeps it. A model
    whose files are refused is left out, said in a warning and put in `refused`
    (id -> (path, why)); one whose files cannot be read for a passing reason
    (out of descriptors) is kept: its load will say.
    """
    warnings: list[str] = []
    taken = set(known)
    out: list[Found] = []
    taken_paths = set(known_paths)
    for folder in dirs:
        models = scan(Path(folder).expanduser(), warnings)
        if not models and Path(folder).expanduser().is_dir():
            warnings.append(f"models folder {folder} holds no model yet (a folder with config.json and "
                            "model*.safetensors, or a .gguf file); add one and run `reload`")
        for model in models:
            key = same_file_key(model.path)
            if model.id in taken or key in taken_paths:
                continue
            taken.add(model.id)
            taken_paths.add(key)
            try:
                why = refusal(model.path)
            except OSError as exc:
                warnings.append(f"{model.path}: cannot check its files now ({exc.strerror or exc}); kept")
                why = None
            if why is not None:
                warnings.append(f"{model.path}: skipped, not a model: {why}")
                if refused is not None:
                    refused[model.id] = (model.path, why)
                continue
            out.append(model)
    return out, warnings


def with_discovered(config: Config) -> tuple[Config, list[str]]:
    """`config` plus the models `pull` fetched (supervisor.models.pulled) and those its `models_dirs`
    hold (config entries win, then pulled ones). What it refused is kept for `last_refused`."""
    from supervisor.config import ModelConfig

    dirs = config.supervisor.models_dirs
    refused: dict[str, tuple[str, str]] = {}
    taken = config.names()
    found, warnings = _pulled(taken, refused)
    if dirs:
        paths = {same_file_key(p) for p in (*(m.path for m in config.models), *(f.path for f in found))}
        more, dir_warnings = discover(dirs, taken | {f.id for f in found}, refused, paths)
        found, warnings = found + more, warnings + dir_warnings
    with _refused_lock:
        _last_refused.clear()
        _last_refused.update(refused)
    if not found:
        return config, warnings
    models = [*config.models, *(ModelConfig(id=f.id, path=f.path) for f in found)]
    return msgspec.structs.replace(config, models=models), warnings


def _pulled(taken: set[str], refused: dict[str, tuple[str, str]]) -> tuple[list[Found], list[str]]:
    """What `pull` fetched and is still on disk, checked as a models folder's finds are."""
    from supervisor.models.pulled import served

    pulled, warnings = served()
    out: list[Found] = []
    for m in pulled:
        if m.id in taken:
            warnings.append(f"pulled model {m.id}: the config names that id too; the config's entry is served")
            continue
        try:
            why = refusal(str(m.path))
        except OSError as exc:
            warnings.append(f"pulled model {m.id}: cannot check its files now ({exc.strerror or exc}); kept")
            why = None
        if why is not None:
            warnings.append(f"pulled model {m.id}: skipped, not a model: {why}")
            refused[m.id] = (str(m.path), why)
            continue
        out.append(Found(id=m.id, path=str(m.path)))
    return out, warnings


def last_refused() -> dict[str, tuple[str, str]]:
    """The models the last `with_discovered` refused: id -> (path, why).

    Why a record here: `serve` builds its Config (at start and on each reload)
    through `with_discovered`, and a refused model is not config; the
    supervisor reads this right after each build to say why such an id is
    not served."""
    with _refused_lock:
        return dict(_last_refused)
