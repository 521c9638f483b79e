"""`unload MODEL`: drain and stop the model's worker (its memory goes back to the OS)."""

from shared import protocol as p
from supervisor.cli._control import call


def add_arguments(parser):
    parser.add_argument("model", help="model id from the config")


def run(args) -> int:
    return call(args, p.UnloadRequest(model=args.model))[0]
