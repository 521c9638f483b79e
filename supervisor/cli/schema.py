"""`schema`: the JSON Schema of every wire message and of the replay trace line.

msgspec generates it from the same Structs the sockets decode with, so it
cannot drift from the code.
"""

import json

import msgspec

from shared import protocol as p


def add_arguments(parser):
    parser.add_argument("--only", metavar="NAME", help="one union (e.g. Command, Published, Snapshot)")


def _unions() -> dict:
    unions = dict(p.all_message_types())
    from supervisor.policy.snapshot import Snapshot

    unions["Snapshot"] = Snapshot
    from supervisor.policy.decisions import Decision
    from supervisor.policy.replay import ReplayTick

    unions["Decision"] = Decision
    unions["ReplayTick"] = ReplayTick
    return unions


def run(args) -> int:
    unions = _unions()
    if args.only:
        if args.only not in unions:
            print(f"memvisor: no schema named {args.only!r}; choose from {', '.join(unions)}")
            return 2
        unions = {args.only: unions[args.only]}
    names = list(unions)
    schemas, components = msgspec.json.schema_components([unions[n] for n in names])
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"memvisor wire protocol v{p.PROTOCOL_VERSION}",
        "description": "Frames are msgpack on the sockets; PUB frames are [topic, message]. "
                       "Replay traces are JSON lines of Snapshot; `replay` prints JSON lines of ReplayTick.",
        "properties": dict(zip(names, schemas)),
        "$defs": components,
    }
    print(json.dumps(doc, indent=2, sort_keys=True))
    return 0
