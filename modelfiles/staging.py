"""Write a model folder so that a half-written one never looks whole.

Both the demo-model generator and the GGUF importer build their files in a
temporary sibling of the target and move them in at the end, `config.json`
last: it is what makes a folder look like a model to mlx-lm and to the
supervisor's discovery.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_model_dir(target: Path) -> Iterator[Path]:
    """A temporary folder beside `target` to write into; moved into `target` when
    the block ends without an error, and removed whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        target.mkdir(exist_ok=True)
        for file in sorted(staging.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(file, target / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
