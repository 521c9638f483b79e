"""DESIGN.md's rooms, checked by folder: the supervisor never imports MLX, the
pure policy (everything under supervisor/policy/) does no I/O, the worker
imports nothing of the supervisor, the supervisor nothing of the worker but its
spawn target, the model-files room (modelfiles/) neither side, and the wire
package none of the others."""

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


# What the supervisor may import of worker/: the function it spawns workers with.
SPAWN_TARGET = "worker.main"


def _imports(path: Path) -> set[str]:
    """Every module `path` imports; `from worker import x` (a package) counts as worker.x
    too, so a worker module imported that way is seen as itself."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module in ("worker", "modelfiles"):
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_supervisor_modules_never_load_mlx():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in _modules("supervisor") + _modules("shared") + _modules("modelfiles")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"import {SPAWN_TARGET}\n"  # what the supervisor may touch of worker/
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


def test_supervisor_imports_of_the_worker_only_its_spawn_target():
    """The worker room may change at will (and import MLX anywhere) but for the one
    function the pool spawns; code of the worker's the supervisor needs runs in a child."""
    for path in _modules("supervisor"):
        reached = {m for m in _imports(path) if m.split(".")[0] == "worker"}
        assert reached <= {"worker", SPAWN_TARGET}, f"{path.relative_to(ROOT)} imports {reached - {SPAWN_TARGET}}"


def test_the_supervisor_runs_the_gguf_importer_only_as_a_child_process():
    """modelfiles.gguf_import converts arrays with MLX: it runs as `python -m`, never in the supervisor."""
    for path in _modules("supervisor"):
        assert "modelfiles.gguf_import" not in _imports(path), path.relative_to(ROOT)
    gguf = (ROOT / "supervisor" / "gguf.py").read_text()
    assert '"-m", "modelfiles.gguf_import"' in gguf


def test_model_files_room_imports_neither_side():
    paths = _modules("modelfiles")
    assert len(paths) >= 7, "what writes model folders lives in modelfiles/"
    for path in paths:
        sides = {m for m in _imports(path) if m.split(".")[0] in ("supervisor", "worker")}
        assert not sides, f"{path.relative_to(ROOT)} imports {sides}"


def test_wire_package_imports_neither_side():
    for path in _modules("shared"):
        sides = {m for m in _imports(path) if m.split(".")[0] in ("supervisor", "worker", "modelfiles")}
        assert not sides, f"{path.relative_to(ROOT)} imports {sides}"
