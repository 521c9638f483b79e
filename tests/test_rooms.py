"""The rooms of docs/architecture.md, checked by folder: the supervisor never imports MLX, the
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
    gguf = (ROOT / "supervisor" / "models" / "gguf_import_cache.py").read_text()
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


def _module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _imported_modules(path: Path, root: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports anywhere: at the top, inside a function,
    or only for type checking (a cycle through annotations is still two rooms that
    cannot be read one without the other)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` folders up
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for imported in names:
            while imported and imported not in known:  # `from a.b import c`: the module a.b.c, else a.b
                imported = imported.rpartition(".")[0]
            if imported:
                found.add(imported)
                break
    return found


def import_cycles(package: Path) -> list[list[str]]:
    """Every set of modules of `package` (a folder) that import each other in a loop
    (Tarjan's strongly connected components), each as a sorted list of names."""
    root = package.parent
    paths = {_module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    graph = {name: _imported_modules(path, root, set(paths)) - {name} for name, path in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def test_the_cycle_finder_sees_type_checking_and_lazy_imports(tmp_path):
    """The finder itself: a loop through a type-checking import and a lazy one is a
    cycle; a module that only imports into the loop is not part of it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import x\n")
    (pkg / "e.py").write_text("from . import d\n")
    assert import_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_cycle_under_the_supervisor():
    """Each module of the supervisor can be read, and changed, without the ones it
    imports reading it back: no two of them import each other, however indirectly."""
    assert import_cycles(ROOT / "supervisor") == []


def test_no_import_cycle_in_the_wire_package():
    """shared/ the same way: the probe's backends take its types from shared/probe/base.py,
    never from the package that chooses among them (which imports them lazily)."""
    assert import_cycles(ROOT / "shared") == []
