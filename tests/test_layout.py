"""The tests' own layout as tests/README.md writes it: a slow test (one that spawns real
processes, or takes seconds in this one) is found in tests/live/, marked slow, named `*_live.py` with a prefix the README's table lists,
no test is named after an issue number, and no module imports from a test module: what
two files share lives in a `*_harness.py` (or another helper module without tests).
And the code's: no two modules under supervisor/, worker/, shared/ share a name, and none of
them, nor of the tests and scripts, passes 500 lines.
"""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LIVE = TESTS / "live"


def _prefixes() -> list[str]:
    rows = [line for line in (TESTS / "README.md").read_text().splitlines() if line.startswith("| `test_")]
    return [name for row in rows for name in re.findall(r"`(test_\w+_)`", row.split("|")[1])]


def _marks_the_module_slow(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return "pytest.mark.slow" in ast.unparse(node.value)
    return False


def test_live_files_are_slow_and_named_by_a_chapter_or_room_prefix():
    prefixes = _prefixes()
    assert "test_p_" in prefixes and "test_api_" in prefixes, prefixes
    files = sorted(LIVE.glob("test_*.py"))
    assert files
    assert [f.name for f in files if not f.name.endswith("_live.py")] == []
    assert [f.name for f in files if not _marks_the_module_slow(f)] == []
    assert [f.name for f in files if not f.name.startswith(tuple(prefixes))] == []
    assert [f.name for f in TESTS.glob("test_*_live.py")] == [], "a live file belongs in tests/live/"


def test_no_test_is_named_after_an_issue_number():
    named = [f"{f.relative_to(TESTS)}::{name}" for f in sorted(TESTS.rglob("test_*.py"))
             for name in re.findall(r"def (test_(?:issue|i)\d+\w*)", f.read_text())]
    assert named == []


def _test_module_imports(path: Path) -> list[str]:
    """The test modules `path` imports from (`from tests.test_x import ...`, `import test_x`, relative)."""
    named = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                   else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        named += [m for m in modules if m.rsplit(".", 1)[-1].startswith("test_")]
    return named


def test_no_module_imports_helpers_from_a_test_module():
    """A test module imported by another is collected twice and couples two files' tests; helpers
    shared by several files live in a harness."""
    importing = {f"{f.relative_to(TESTS)}": names for f in sorted(TESTS.rglob("*.py"))
                 if (names := _test_module_imports(f))}
    assert importing == {}


def _slow_marks(path: Path) -> int:
    """How often `path` says `pytest.mark.slow` (a decorator, pytestmark, a param's marks)."""
    return sum(1 for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr == "slow"
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def test_every_slow_test_lives_in_tests_live():
    """The folder, not only the marker, says what is slow: `tests/` runs in minutes, whole."""
    marked = [f.name for f in sorted(TESTS.glob("*.py")) if _slow_marks(f)]
    assert marked == []
    assert all(_slow_marks(f) for f in LIVE.glob("test_*.py"))  # the check sees the live files' marks


ROOT = TESTS.parent
ROOMS = ("supervisor", "worker", "shared")
MAX_MODULE_LINES = 500

# Basenames two modules may share, each with why. Commands under supervisor/cli/ are named for
# the word the user types (`python -m supervisor status`), so the pure decision or the worker's
# part of the same job keeps its own name beside them; a policy/ module and its I/O shell of
# one job share it on purpose (the decision, then the doing). The last group are collisions
# not yet renamed: each is a follow-up, listed so no new one joins them.
SHARED_NAMES = {
    "drill.py": "cli/drill.py is the command; worker/drill.py the memory a worker grows for it",
    "reload.py": "cli/reload.py is the command; supervisor/models/reload.py applies the re-read config",
    "replay.py": "cli/replay.py is the command; policy/replay.py feeds snapshots to the policy",
    "status.py": "cli/status.py is the command; policy/status.py the guard's status, pure",
    "tiers.py": "cli/tiers.py is the command; policy/tiers.py the T rules",
    "prefetch.py": "policy/prefetch.py decides, supervisor/models/prefetch.py does it",
    "spares.py": "policy/spares.py decides, supervisor/workers/spares.py does it",
}


def _modules() -> list[Path]:
    return sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py"))


def test_no_two_modules_share_a_name():
    """A module's name says what it holds, so a name names one module: `gate.py` for the admission
    queue and for the browser checks sent readers to the wrong file."""
    by_name: dict[str, list[str]] = {}
    for path in _modules():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert {name: paths for name, paths in shared.items() if name not in SHARED_NAMES} == {}
    assert sorted(set(SHARED_NAMES) - set(shared)) == [], "an allowed name no longer collides: drop it"


# The line limit reaches past the rooms: a test file or a script of 800 lines holds several
# subjects as surely as a module does, and a reader looking for one test opens the wrong file.
LIMITED = (*ROOMS, "tests", "scripts")


def test_no_module_passes_500_lines():
    """A module over 500 lines holds more than one thing (STYLE: modules named for what they hold):
    the product's rooms, the tests (tests/live/ too) and the scripts alike."""
    files = sorted(p for room in LIMITED for p in (ROOT / room).rglob("*.py"))
    assert any(p.parent == LIVE for p in files) and any(p.parent.name == "scripts" for p in files)
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
