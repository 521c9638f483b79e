"""The built-in demo: a few small local models, generated on first run.

`python -m supervisor serve` with no config must work on a fresh machine with
no download, so the demo models are made here (random weights, a tokenizer
trained offline) under the user's cache directory, once, with a progress bar.
`demo-vision` (a small SmolVLM, modelfiles/vlmgen.py) joins them where the
vision extra (mlx-vlm) is installed, so `serve` answers an image request too.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from shared.sizes import MiB, format_size
from supervisor.config import Config, ModelConfig

# id, weight bytes, seed, pinned
DEMO_MODELS = (
    ("demo-pinned", 16 * MiB, 1, True),
    ("demo-small", 32 * MiB, 2, False),
    ("demo-medium", 64 * MiB, 3, False),
)
DEMO_VISION = "demo-vision"  # ~28 MiB of float32 (modelfiles/vlmgen.py's default dims)
DEMO_VISION_SEED = 4


def vision_installed() -> bool:
    """Whether the workers can run a vision model: mlx-vlm is installed (found, never imported:
    it imports MLX, which the supervisor does not)."""
    return importlib.util.find_spec("mlx_vlm") is not None


def models_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memvisor" / "models"


def demo_config(root: Path | None = None) -> Config:
    root = root or models_cache_dir()
    models = [ModelConfig(id=name, path=str(root / name), pinned=pinned, max_concurrency=4)
              for name, _size, _seed, pinned in DEMO_MODELS]
    if vision_installed():
        models.append(ModelConfig(id=DEMO_VISION, path=str(root / DEMO_VISION), max_concurrency=4))
    return Config(models=models)


def ensure_demo_models(root: Path | None = None) -> list[Path]:
    """Generate the demo models that are missing; show progress while doing so."""
    from modelfiles.modelgen import make_model  # numpy + tokenizers, no MLX

    root = root or models_cache_dir()
    missing = [(n, s, seed) for n, s, seed, _p in DEMO_MODELS if not (root / n / "config.json").exists()]
    made = [root / n for n, *_ in DEMO_MODELS]
    if vision_installed():
        made.append(ensure_vision_model(root / DEMO_VISION))
    if not missing:
        return made
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn()) as bar:
        for name, size, seed in missing:
            task = bar.add_task(f"making demo model {name} ({format_size(size)})", total=size)
            # float32: MLX on a CPU decodes it about 5x faster than float16

            def progress(done: int, total: int, task: TaskID = task) -> None:
                bar.update(task, completed=done, total=total)

            make_model(root / name, size, seed, progress, force=True, dtype="float32")
            bar.update(task, completed=bar.tasks[task].total)
    return made


def ensure_vision_model(path: Path) -> Path:
    """demo-vision, written once (about a second: numpy weights, the demo's cached tokenizer)."""
    if not (path / "config.json").exists():
        from modelfiles.vlmgen import make_vision_model  # numpy + tokenizers, no MLX

        make_vision_model(path, seed=DEMO_VISION_SEED, force=True)
    return path
