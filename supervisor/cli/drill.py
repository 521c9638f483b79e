"""`drill MODEL --rate 1GiB/s --to 3GiB`: the fire drill.

Makes the model's worker grow real MLX allocations at the given rate, so a
user can watch the guard act on their own machine (`watch` in another
terminal). Refused unless the supervisor runs with --allow-drills.
"""

import sys

from shared import protocol as p
from shared.sizes import SizeError, parse_size
from supervisor.cli._control import call


def add_arguments(parser):
    parser.add_argument("model", help="a loaded model id")
    parser.add_argument("--rate", default="1GiB/s", help="growth rate, SIZE/s (default 1GiB/s)")
    parser.add_argument("--to", default="1GiB", help="stop growing at SIZE (default 1GiB)")
    parser.add_argument("--stop", action="store_true", help="end a running drill and free its memory")


def run(args) -> int:
    if args.stop:
        return call(args, p.DrillRequest(model=args.model, rate=0, to=0, stop=True))[0]
    rate_text = args.rate[:-2] if args.rate.endswith("/s") else args.rate
    try:
        rate, to = parse_size(rate_text), parse_size(args.to)
    except SizeError as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 2
    if rate <= 0 or to <= 0:
        print("memvisor: --rate and --to must be more than 0", file=sys.stderr)
        return 2
    return call(args, p.DrillRequest(model=args.model, rate=rate, to=to))[0]
