"""One hash of everything the policy tick decides, over every bench_policy scenario.

A speed change to `supervisor/policy/` must not change a single byte the
tick gives back. This runs each scenario of `scripts/bench_policy.py` (quiet,
steady, pressure) at 1, 8, 64 and 512 workers: the two snapshots the bench
alternates, then a chain of TICKS ticks that feeds each tick's state into the
next (the clock moves a second a tick and the host's free memory jitters, so
levels, grace, caps and growth all move). Every TickResult (decisions in
order, each HandOutLimits spelt out per worker by `decisions.per_worker`; the
state with its dict orders, ceilings, levels, projection) is encoded to JSON
and fed to one SHA-256; the hash is printed, with one per
scenario.

    python scripts/policy_fingerprint.py [--ticks 20]

Run it before and after a change: the last line must not move.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_policy  # noqa: E402
import msgspec  # noqa: E402

from supervisor.policy.decisions import per_worker  # noqa: E402
from supervisor.policy.pressure import TickResult, tick  # noqa: E402

SCENARIOS = ("quiet", "steady", "pressure")
_encoder = msgspec.json.Encoder()  # dicts in insertion order: strict


def _encode(result: TickResult) -> bytes:
    """The result with its HandOutLimits spelt out as one ApplyLimits/SetConcurrency a worker, in
    order: the form the tick gave before the batch, so a hash from before it still compares."""
    return _encoder.encode(msgspec.structs.replace(result, decisions=per_worker(result.decisions)))


def _chain(first: bench_policy.Snapshot, ticks: int, digest: hashlib._Hash) -> None:
    """TICKS ticks, each with the state the one before gave back."""
    s = first
    for i in range(ticks):
        result = tick(s)
        digest.update(_encode(result))
        host = s.host
        if host is not None and host.free is not None:
            host = msgspec.structs.replace(host, free=host.free + (4096 if i % 2 else -4096))
        s = msgspec.structs.replace(s, now=s.now + 1.0, host=host, state=result.state)


def fingerprint(ticks: int) -> tuple[dict[str, str], str]:
    whole = hashlib.sha256()
    per: dict[str, str] = {}
    for name in SCENARIOS:
        digest = hashlib.sha256()
        for n in bench_policy.COUNTS:
            a, b = getattr(bench_policy, name)(n)
            for s in (a, b, a):
                digest.update(_encode(tick(s)))
            _chain(a, ticks, digest)
        per[name] = digest.hexdigest()
        whole.update(digest.digest())
    return per, whole.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=20, help="ticks in each chained run")
    args = parser.parse_args()
    per, whole = fingerprint(args.ticks)
    for name, h in per.items():
        print(f"{name:8s} {h}")
    print(f"policy fingerprint: {whole}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
