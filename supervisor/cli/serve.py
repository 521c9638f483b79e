"""`serve`: run the supervisor, its workers and the HTTP front door."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import msgspec

from shared.sizes import SizeError, parse_size
from supervisor.config import Config
from supervisor.config_checks import parse_http
from supervisor.config_file import ConfigError, config_from, load_config
from supervisor.models.discovery import folder_problem, with_discovered
from supervisor.policy.wired import wiring_line

log = logging.getLogger("memvisor.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config ([guard], [supervisor], [[models]]); "
                        "default: the built-in demo models")
    parser.add_argument("--http", metavar="HOST:PORT", help="HTTP front door address (default 127.0.0.1:8000); "
                        "'off' serves no HTTP")
    parser.add_argument("--tier", help="memory guard tier: safe, balanced, aggressive or custom")
    parser.add_argument("--custom-ceiling", metavar="SIZE", help="ceiling for the custom tier, e.g. 12GiB")
    parser.add_argument("--budget", metavar="SIZE", help="never count more than SIZE as the machine's memory")
    parser.add_argument("--allow-drills", action="store_true", help="allow `drill` (fire drills) on this supervisor")
    parser.add_argument("--host-name", metavar="NAME", help="this host's name in the X-Memvisor-Host header "
                        "and the routing signals (default: the machine's name)")
    parser.add_argument("--max-workers", type=int, default=64, help="ledger slots, i.e. worker processes at once")
    parser.add_argument("--models-dir", metavar="DIR", action="append", default=[],
                        help="serve every model folder (and .gguf file) under DIR, the id taken from its "
                        "name; Hugging Face cache layouts are understood (repeatable)")
    parser.add_argument("--trace", metavar="FILE", type=Path,
                        help="append every policy snapshot to FILE (JSON lines) for `replay`")


def build_config(args: argparse.Namespace) -> Config:
    """The config file (or the demo) with the command-line overrides applied, re-validated."""
    if args.config:
        config = load_config(args.config)
    elif args.models_dir:
        config = Config()  # the models folders alone, no demo
    else:
        from supervisor.models.demo import demo_config, ensure_demo_models

        ensure_demo_models()
        config = demo_config()
    raw = msgspec.to_builtins(config)
    if args.tier is not None:
        raw["guard"]["tier"] = args.tier
    for flag, key in ((args.custom_ceiling, "custom_ceiling"), (args.budget, "budget")):
        if flag is not None:
            try:
                raw["guard"][key] = parse_size(flag)
            except SizeError as exc:
                raise ConfigError(f"--{key.replace('_', '-')}: {exc}") from None
    if args.http not in (None, "off"):
        raw["supervisor"]["http"] = args.http
    if args.allow_drills:
        raw["supervisor"]["allow_drills"] = True
    if args.host_name is not None:
        raw["supervisor"]["host_name"] = args.host_name
    _check_models_dirs(raw["supervisor"]["models_dirs"], args)
    raw["supervisor"]["models_dirs"] = [*raw["supervisor"]["models_dirs"], *args.models_dir]
    config = config_from(raw, "command line")
    config, warnings = with_discovered(config)
    for warning in warnings:
        log.warning("%s", warning)
    return config


def _check_models_dirs(from_file: list[str], args: argparse.Namespace) -> None:
    """A models folder that is missing or unreadable stops the start (and refuses a reload,
    the running config kept): a typo must not serve zero models behind a warning."""
    named = [(f"{args.config}: supervisor.models_dirs[{i}]", d) for i, d in enumerate(from_file)]
    named += [("--models-dir", d) for d in args.models_dir]
    for where, folder in named:
        problem = folder_problem(folder)
        if problem is not None:
            raise ConfigError(f"{where}: {problem}")


def _taken(args: argparse.Namespace, config: Config) -> str | None:
    """What another process holds that this supervisor needs, in one line with the remedy,
    checked before anything starts (a taken port used to print six tracebacks first): the
    runtime dir of a live supervisor, then the HTTP address. The arbiter checks both again
    as it binds (another process may take them in between); this is the early, quiet word."""
    from supervisor.http.server import FrontDoorError, bind
    from supervisor.wiring.bus import RuntimeDirBusy, claim_runtime_dir

    try:
        claim_runtime_dir(args.runtime_dir)
    except RuntimeDirBusy as exc:
        return str(exc)
    except OSError:  # a folder we may not read: the arbiter's own checks of it say why
        pass
    if args.http == "off":
        return None
    host, port = parse_http(config.supervisor.http)
    if port == 0:
        return None
    try:
        bind(host, port).close()
    except FrontDoorError as exc:
        return f"{exc}; choose another address with --http HOST:PORT (or [supervisor] http in the config)"
    return None


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"memvisor: configuration error: {exc}", file=sys.stderr)
        return 2
    problems = config.path_problems()  # at start, not at the first load
    if problems:
        for problem in problems:
            print(f"memvisor: configuration error: {args.config or 'demo'}: {problem}", file=sys.stderr)
        return 2
    if not 1 <= args.max_workers <= 4096:
        print("memvisor: --max-workers must be 1..4096", file=sys.stderr)
        return 2
    from supervisor.arbiter import Arbiter
    from supervisor.http.server import FrontDoorError
    from supervisor.wiring.bus import BusError, RuntimeDirBusy

    refusal = _taken(args, config)
    if refusal is not None:
        print(f"memvisor: {refusal}", file=sys.stderr)
        return 2

    wiring = wiring_line(config.guard.wire_weights, sys.platform == "darwin")  # M2: said at start when on
    if wiring:
        log.log(logging.WARNING if config.guard.wire_weights else logging.INFO, "%s", wiring)

    arbiter = Arbiter(config, args.runtime_dir, max_workers=args.max_workers, http=args.http != "off",
                      trace=args.trace, reload_config=lambda: build_config(args),
                      config_file=args.config)
    try:
        return asyncio.run(arbiter.run())
    except (FrontDoorError, RuntimeDirBusy, BusError, PermissionError) as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 2
