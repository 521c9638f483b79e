"""Chaos suite: abuse a real supervisor and count what it costs.

Every scenario runs real processes on this machine, over loopback and ipc
only, bounded in time and count:

  stream-kill     streaming clients while workers are SIGKILLed and SIGSTOPped
  long-steps      every engine step longer than the heartbeat window (no kill may follow)
  obedience       how long a command waits for a step boundary during a long prefill
  sup-kill        the supervisor SIGKILLed and restarted on the same runtime dir
  respawn         workers SIGKILLed over and over: fd/thread/RSS/zombie counts per cycle
  http-fuzz       random and hostile HTTP bodies (nesting, sizes, context, short bodies)
  zmq-fuzz        distinct garbage frames on the ZeroMQ sockets
  configs         configs that used to break the system at run time
  slow-subs       subscribers that never read, during a fire drill
  cross-site      a web page's POSTs (text/plain, foreign Origin) and DNS-rebinding Host headers
  slow-loris      connections whose headers never end, past the descriptor limit; /health, SIGTERM
  slow-reload     SIGHUP over a models folder of many thousands of empty folders, streams running
  hostile-files   a FIFO as model.safetensors, a sparse multi-GB config.json, GGUFs that lie
  kv-attacks      a user's files and links under kv/, an evicting budget, a NaN and a wrong-shape entry
  shared-root     a caches folder others could write, made before the server
  key-probe       one API key guessing another's secret from cached-token counts (memory, disk)
  plain-unload    an ordinary key unloading a pinned model through Ollama's keep_alive 0
  spares          every load taking a spare while spares are SIGKILLed and SIGSTOPped
  spare-squeeze   a spare's slow load when the ceiling drops to hard pressure

and prints one table; the last line is the headline:

  chaos: N requests, H hung, F false kills, E 5xx, O orphans, X changed from a foreign origin,
         T files outside the tier touched, K cross-key hits

    python scripts/chaos.py [--quick] [--only SCENARIO ...] [--cycles N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chaos_swap as swap  # noqa: E402
import chaos_trust as trust  # noqa: E402
from _chaos_fuzz import configs, http_fuzz, zmq_fuzz  # noqa: E402  (scripts/ is on sys.path as the script's folder)
from _chaos_harness import Context, Row  # noqa: E402
from _chaos_hostile import cross_site, hostile_files, slow_loris, slow_reload  # noqa: E402
from _chaos_processes import long_steps, obedience, respawn, slow_subs, stream_kill, sup_kill  # noqa: E402

SCENARIOS = {"stream-kill": stream_kill, "long-steps": long_steps, "obedience": obedience, "sup-kill": sup_kill,
             "respawn": respawn, "http-fuzz": http_fuzz, "zmq-fuzz": zmq_fuzz, "configs": configs,
             "slow-subs": slow_subs, "cross-site": cross_site, "slow-loris": slow_loris, "slow-reload": slow_reload,
             "hostile-files": hostile_files, **trust.SCENARIOS, **swap.SCENARIOS}


def table(rows: list[Row]) -> str:
    head = f"{'scenario':<13} {'requests':>8} {'finished':>8} {'clear':>6} {'hung':>5} {'5xx':>4} " \
           f"{'orphans':>7} {'false kills':>11} {'foreign':>7} {'touched':>7} {'x-key':>5}  {'leaks per cycle':<36} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.scenario:<13} {r.requests:>8} {r.finished:>8} {r.clear:>6} {r.hung:>5} {r.e5xx:>4} "
                     f"{r.orphans:>7} {r.false_kills:>11} {r.foreign:>7} {r.touched:>7} {r.cross_key:>5}  "
                     f"{r.leaks:<36} {r.note}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute or two)")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run only these scenarios")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of the streaming scenarios")
    parser.add_argument("--cycles", type=int, default=300, help="respawn cycles (bounded by --respawn-budget)")
    parser.add_argument("--respawn-budget", type=float, default=180.0, help="seconds the respawn scenario may take")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep models, configs and serve logs in DIR")
    parser.add_argument("--json", type=Path, help="also write the rows and figures as JSON here")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("chaos.py reads /proc: Linux only", file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memvisor-chaos-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(args, work)
        for name in args.only or SCENARIOS:
            t0 = time.monotonic()
            print(f"-- {name} ...", file=sys.stderr, flush=True)
            rows.append(SCENARIOS[name](ctx))
            print(f"   {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "figures": ctx.figures,
                                         "wall_s": wall}, indent=2))
    total = sum(r.requests for r in rows if r.scenario not in ("zmq-fuzz", "respawn"))
    print(f"wall time {wall:.0f} s")
    print(f"chaos: {total} requests, {sum(r.hung for r in rows)} hung, {sum(r.false_kills for r in rows)} false kills, "
          f"{sum(r.e5xx for r in rows)} 5xx, {sum(r.orphans for r in rows)} orphans, "
          f"{sum(r.foreign for r in rows)} changed from a foreign origin, "
          f"{sum(r.touched for r in rows)} files outside the tier touched, {sum(r.cross_key for r in rows)} cross-key hits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
