"""`load MODEL`: load through the running supervisor, under the same admission rules as HTTP (SPEC A)."""

from shared import protocol as p
from supervisor.cli._control import call


def add_arguments(parser):
    parser.add_argument("model", help="model id from the config")


def run(args) -> int:
    return call(args, p.LoadRequest(model=args.model))[0]
