"""The tests' own layout as tests/README.md writes it: a slow test (one that spawns real
processes, or takes seconds in this one) is found in tests/live/, marked slow, named `*_live.py` with a prefix the README's table lists,
no test is named after an issue number, and no module imports from a test module: what
two files share lives in a `*_harness.py` (or another helper module without tests)."""

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
