"""`python -m supervisor COMMAND ...`

Each command lives in its own module under `supervisor.cli` exposing
`add_arguments(parser)` and `run(args) -> int`. Only the chosen command's
module is imported, so `status` does not pay for the HTTP stack and one
command's import problem cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from supervisor.wiring.runtime import default_runtime_dir

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("supervisor.cli.serve", "run the supervisor, its workers and the HTTP front door"),
    "status": ("supervisor.cli.status", "show the guard status and the workers of a running supervisor"),
    "watch": ("supervisor.cli.watch", "follow a running supervisor's published messages live"),
    "load": ("supervisor.cli.load", "load a model through the running supervisor"),
    "unload": ("supervisor.cli.unload", "unload a model through the running supervisor"),
    "ps": ("supervisor.cli.ps", "loaded and known models with their memory, idle time and expiry"),
    "reload": ("supervisor.cli.reload", "re-read the config and rescan model folders without a restart"),
    "drill": ("supervisor.cli.drill", "fire drill: make a worker grow real memory (needs serve --allow-drills)"),
    "probe": ("supervisor.cli.probe", "show what the guard sees on this machine"),
    "tiers": ("supervisor.cli.tiers", "preview every tier's ceiling now, or under what-if inputs"),
    "replay": ("supervisor.cli.replay", "feed recorded policy snapshots to the policy, print decisions"),
    "schema": ("supervisor.cli.schema", "print the JSON Schema of every wire message"),
    "import-gguf": ("supervisor.cli.import_gguf", "write an MLX model folder from a GGUF file"),
    "lab": ("supervisor.cli.lab", "run pressure scenarios on real workers; a verdict and a PNG each"),
    "pull": ("supervisor.cli.pull", "fetch a model from the Hugging Face hub and serve it"),
    "rm": ("supervisor.cli.rm", "remove a pulled model and its files"),
    "chat": ("supervisor.cli.chat", "chat with a model in the terminal (one prompt, or a session)"),
}


def prog_name(argv0: str) -> str:
    """How the user ran us, for `--help` and usage lines: `memvisor` (the installed command,
    or whatever name it has), or `python -m supervisor` (argv[0] is then this package's
    __main__.py, which argparse would print as it is)."""
    path = Path(argv0)
    if path.name == "__main__.py" or not path.name:
        return "python -m supervisor"
    return path.name


def _base_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog_name(sys.argv[0] if sys.argv else ""),
        description="memvisor: run several MLX models, one process each, under a memory guard.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="debug log output"
    )
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-dir",
        type=Path,
        default=None,
        help=f"the supervisor's sockets and state (default: {default_runtime_dir()})",
    )


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = _base_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _common(p)
        if name == command:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.runtime_dir is None:
        args.runtime_dir = default_runtime_dir()
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `... | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
