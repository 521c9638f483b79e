"""DESIGN.md's rooms, checked by folder: the supervisor never imports MLX, the
pure policy (everything under supervisor/policy/) does no I/O, the worker
imports nothing of the supervisor, and the wire package imports neither."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What a module under supervisor/policy/ may import besides its own package:
# pure standard-library modules, msgspec, and the wire's pure types.
POLICY_MAY_IMPORT = {
    "__future__", "typing", "math", "enum", "operator", "collections.abc", "msgspec",
    "shared.sizes", "shared.limits", "shared.protocol", "shared.host", "shared.states", "shared.memory", "shared.vocab",
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_supervisor_modules_never_load_mlx():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in _modules("supervisor") + _modules("shared")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "import worker.main, worker.modelgen\n"  # what the supervisor may touch of worker/
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.') or m.startswith('mlx_lm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_policy_folder_imports_nothing_that_does_io():
    paths = _modules("supervisor/policy")
    assert len(paths) >= 8, "the pure core lives in supervisor/policy/"
    for path in paths:
        imports = _imports(path)
        foreign = {m for m in imports if m not in POLICY_MAY_IMPORT and not m.startswith("supervisor.policy")}
        assert not foreign, f"{path.relative_to(ROOT)} imports {foreign}"


def test_worker_imports_nothing_from_the_supervisor():
    for path in _modules("worker"):
        policy = {m for m in _imports(path) if m == "supervisor" or m.startswith("supervisor.")}
        assert not policy, f"{path.relative_to(ROOT)} imports {policy}"


def test_wire_package_imports_neither_side():
    for path in _modules("shared"):
        sides = {m for m in _imports(path) if m.split(".")[0] in ("supervisor", "worker")}
        assert not sides, f"{path.relative_to(ROOT)} imports {sides}"
