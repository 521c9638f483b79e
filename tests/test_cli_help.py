"""`--help` names the command the way the user ran it: `memvisor` for the installed command,
`python -m supervisor` for the module."""

from __future__ import annotations

import subprocess
import sys

from tests.chat_harness import ROOT, cli_env

# what pip writes for [project.scripts] memvisor = "supervisor.cli:main"
ENTRY_POINT = f"""#!{sys.executable}
import re
import sys
from supervisor.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def test_help_of_the_installed_command_names_memvisor(tmp_path):
    """Before: `memvisor --help` said `usage: python -m supervisor`."""
    command = tmp_path / "bin" / "memvisor"
    command.parent.mkdir()
    command.write_text(ENTRY_POINT)
    command.chmod(0o755)
    top = subprocess.run([str(command), "--help"], env=cli_env(), capture_output=True, text=True, timeout=60)
    sub = subprocess.run([str(command), "status", "--help"], env=cli_env(), capture_output=True, text=True,
                         timeout=60)
    assert top.returncode == 0 and top.stdout.startswith("usage: memvisor [-h]"), top.stdout
    assert sub.stdout.startswith("usage: memvisor status "), sub.stdout


def test_help_of_the_module_names_python_dash_m_supervisor():
    out = subprocess.run([sys.executable, "-m", "supervisor", "watch", "--help"], cwd=ROOT, env=cli_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("usage: python -m supervisor watch "), out.stdout
    assert "--new" in out.stdout
