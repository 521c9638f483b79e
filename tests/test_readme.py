"""The README's set-up commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sh_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", text, re.S)]


def test_ci_runs_exactly_the_readme_test_command():
    blocks = _sh_blocks((ROOT / "README.md").read_text())
    test_commands = [b for b in blocks if "pytest" in b]
    assert len(test_commands) == 1, test_commands
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0] in ci_lines


def test_readme_serve_command_runs_the_built_in_default():
    blocks = _sh_blocks((ROOT / "README.md").read_text())
    assert any(b.endswith("python -m supervisor serve") for b in blocks)
