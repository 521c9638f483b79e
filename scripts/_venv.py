"""Third-party programs in virtual environments of their own, installed once under the cache.

The scripts that drive a real client or router (LiteLLM in `fleet.py`, Open WebUI,
lm-evaluation-harness) run it from its own venv: each pins its dependencies its own way
(LiteLLM `openai<3`, Open WebUI ~150 exact pins, lm-eval torch and datasets), none is a
dependency of memvisor, and one never breaks another or the project's venv. A venv is
made once per pinned release (`<cache>/<name>-<pin>`), marked installed only when pip
finished, and checked at every use for interpreter start-up hooks a clean install does
not have (a compromised release ran its code through a `.pth` file).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# What a clean install may hold as interpreter start-up hooks: setuptools' own, and the
# editable-install finder some packages ship (named here when one is met, never a glob).
ALLOWED_PTH = frozenset({"distutils-precedence.pth"})

# torch from the CPU build on this machine's disk, never a CUDA build of several GB that
# a bare `torch` requirement (transformers, sentence-transformers, lm-eval) would pull.
CPU_TORCH = "torch==2.13.0"


def cache_root() -> Path:
    """`$MEMVISOR_CACHE`, else `$XDG_CACHE_HOME/memvisor`, else `~/.cache/memvisor`."""
    base = os.environ.get("MEMVISOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"), "memvisor")
    return Path(base)


def say(tag: str, text: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def ensure_venv(name: str, pin: str, requirements: list[str], *, constraints: tuple[str, ...] | list[str] = (),
                allowed_pth: frozenset[str] = ALLOWED_PTH) -> Path:
    """The venv `<cache>/<name>-<pin>` with `requirements` installed (once), checked for hooks.

    `constraints` go to pip as a constraints file (e.g. CPU_TORCH): they bound what other
    packages pull without installing anything themselves.
    """
    venv = cache_root() / f"{name}-{pin}"
    marker = venv / ".installed"
    if not marker.exists():
        say(name, f"installing {' '.join(requirements)} into {venv} (once)")
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *requirements]
        if constraints:
            (venv / "constraints.txt").write_text("".join(f"{c}\n" for c in constraints))
            pip += ["--constraint", str(venv / "constraints.txt")]
        subprocess.run(pip, check=True)
        marker.write_text(pin)
        say(name, f"installed in {time.monotonic() - started:.0f} s")
    check_start_up_hooks(venv, allowed_pth)
    return venv


def check_start_up_hooks(venv: Path, allowed: frozenset[str] = ALLOWED_PTH) -> None:
    hooks = {p.name for p in venv.glob("lib/python*/site-packages/*.pth")} - allowed
    if hooks:
        raise SystemExit(f"refusing to run from {venv}: unexpected start-up hooks {sorted(hooks)} "
                         "(a compromised release installs one); remove the folder and check the pin")
