"""DESIGN.md's rooms: the supervisor never imports MLX, the policy does no I/O,
the worker takes no policy decision."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The pure core: the policy, its inputs and its rules. It may import only these.
POLICY_MODULES = ["policy", "ceilings", "admission", "tiers", "group", "decisions", "snapshot", "status"]
POLICY_MAY_IMPORT = {"__future__", "typing", "math", "msgspec", "shared.sizes", "shared.limits", "shared.protocol"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_supervisor_modules_never_load_mlx():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "supervisor").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "import worker.main, worker.weights, worker.modelgen\n"  # what the supervisor may touch of worker/
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.') or m.startswith('mlx_lm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_policy_core_imports_nothing_that_does_io():
    for name in POLICY_MODULES:
        imports = _imports(ROOT / "supervisor" / f"{name}.py")
        foreign = {m for m in imports if m not in POLICY_MAY_IMPORT and not m.startswith("supervisor.")}
        assert not foreign, f"supervisor/{name}.py imports {foreign}"
        inner = {m for m in imports if m.startswith("supervisor.")}
        assert inner <= {f"supervisor.{n}" for n in POLICY_MODULES}, f"supervisor/{name}.py imports {inner}"


def test_worker_takes_no_policy_decision():
    """The worker may read the probes (its own footprint) but never the policy."""
    for path in (ROOT / "worker").glob("*.py"):
        policy = {m for m in _imports(path) if m.startswith("supervisor") and m != "supervisor.probe"}
        assert not policy, f"{path.name} imports {policy}"
