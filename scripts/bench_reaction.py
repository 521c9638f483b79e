"""How fast the guard reacts to a runaway worker, against the seed's fixed 1 s poll.

A real supervisor runs one non-pinned model under a custom ceiling a little
above what it uses. Each trial makes the worker busy with a long generation,
then starts a fire drill in it (real MLX allocations at --rate). The drill
crosses the soft and then the hard watermark; the guard must answer (SPEC P6:
abort the busy non-pinned worker's requests, which frees the drill) before the
group goes over the ceiling. Measured per trial, all on CLOCK_MONOTONIC,
which the worker and the supervisor share:

  decision  first sample at or over the hard watermark -> the decision sent
  returned  that sample -> the first sample back under soft (or the exit)
  overshoot peak group usage above the ceiling, as a share of the ceiling

The same trials run again with the enforcer held to a fixed 1 s poll and no
wake-up on watermark samples (the seed's behaviour), in the same run.

No spare worker runs beside the model (spare_workers = 0): at hard the guard
stops a spare first (SPEC W), and the spare's exit can take the group back
under hard before the drill's worker needs an answer; such a trial measured
nothing about the runaway and went uncounted (5 of 10 trials with the default
of one spare). How spares are stopped under pressure is bench_swap's and the
W tests' subject.

    python scripts/bench_reaction.py [--trials 20] [--baseline-trials 8] [--rate 1GiB] [--headroom 1GiB]

Last line: `reaction p99: X ms (1 s poll: Y ms)`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared import protocol as p  # noqa: E402
from shared.sizes import MiB, format_size, parse_size  # noqa: E402
from supervisor.arbiter import Arbiter  # noqa: E402
from supervisor.config import Config, GuardConfig, ModelConfig, SupervisorConfig  # noqa: E402
from supervisor.policy import decisions as d  # noqa: E402
from supervisor.policy.pressure import TickResult  # noqa: E402

ACTIONS = (d.AbortWorkerRequests, d.Stop, d.MarkForUnload)


def last_tick(arb: Arbiter) -> TickResult:
    """The guard's latest tick; a running arbiter has ticked by the time a model is loaded."""
    last = arb.enforcer.last
    if last is None:
        raise RuntimeError("the guard has not ticked yet")
    return last


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Samples:
    """Every sample the supervisor publishes, as (t, usage), read off the PUB socket."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"sample")
        self.sock.connect(endpoint)
        self.codec = p.Codec(p.Published)
        self.items: list[p.Sample] = []

    def drain(self) -> None:
        while self.sock.poll(0):
            _topic, frame = self.sock.recv_multipart()
            msg = self.codec.decode(frame)
            if isinstance(msg, p.Sample):
                self.items.append(msg)


async def trial(arb: Arbiter, samples: Samples, rate: int, to: int) -> dict | None:
    handle = await arb.models.load("victim")
    stream = await arb.service.generate("victim", p.Generate(request_id="", prompt="tell me a long story",
                                                     max_tokens=3000))  # within the 4,096-token context (a longer one is refused)
    deadline = time.monotonic() + 10
    while not (handle.sample and handle.sample.running) and time.monotonic() < deadline:
        arb.wake()
        await asyncio.sleep(0.01)
    arb.wake()
    await asyncio.sleep(0.2)
    if handle.sample is None:
        raise RuntimeError(f"{handle.worker_id} sent no sample in 10 s")
    last = last_tick(arb)
    c = last.ceilings
    others = last.usage - handle.sample.memory.usage
    soft, hard, ceiling = c.soft, c.hard, c.ceiling
    samples.drain()
    samples.items.clear()
    mark = len(arb.enforcer.executed)
    exited_at: list[float] = []
    handle.exited.add_done_callback(lambda _f: exited_at.append(time.monotonic()))
    start = time.monotonic()
    arb.pool.command(handle, p.Drill(rate=rate, to=to))
    while time.monotonic() - start < 15:
        await asyncio.sleep(0.002)
        samples.drain()
        done = stream.done or not handle.live
        if done and (exited_at or any(s.memory.usage + others < soft for s in samples.items if s.t > start + 0.05)):
            break
    arb.pool.command(handle, p.DrillStop())
    if not stream.done:
        arb.service.cancel(stream)
    samples.drain()
    mine = [s for s in samples.items if s.worker_id == handle.worker_id and s.t >= start]
    over_hard = [s for s in mine if s.memory.usage + others >= hard]
    actions = [(t, x) for t, x in list(arb.enforcer.executed)[mark:]
               if isinstance(x, ACTIONS) and x.worker == handle.worker_id]
    if not over_hard or not actions:
        print(f"  trial: no hard crossing or no action (samples {len(mine)}, actions {len(actions)})")
        return None
    t_hard = over_hard[0].t
    t_decision = actions[0][0]
    back = [s.t for s in mine if s.t > t_decision and s.memory.usage + others < soft]
    t_back = min(back + exited_at) if (back or exited_at) else float("nan")
    peak = max(s.memory.usage for s in mine) + others
    first = mine[0]
    grown = [s for s in mine if s.t <= t_decision]
    drill_rate = ((grown[-1].memory.usage - first.memory.usage) / (grown[-1].t - first.t)
                  if len(grown) > 1 and grown[-1].t > first.t else float("nan"))
    # wait for the episode to end before the next trial
    for _ in range(500):
        if last_tick(arb).level == "ok" and not arb.pool.running(handle):
            break
        arb.wake()
        await asyncio.sleep(0.01)
    return {
        "decision_ms": (t_decision - t_hard) * 1000,
        "returned_ms": (t_back - t_hard) * 1000,
        "overshoot": max(0, peak - ceiling) / ceiling,
        "action": type(actions[0][1]).__name__,
        "drill_rate": drill_rate,
    }


async def run_mode(model_dir: Path, runtime: Path, args, *, baseline: bool) -> list[dict]:
    config = Config(
        # hot_cache_max=0: the trial measures the reaction to growth, not the prompt cache;
        # once this was also needed because C12 reserved cache used + 512 MiB
        # (1-byte limits: no watermark crossing was ever reported)
        guard=GuardConfig(tier="custom", custom_ceiling=0, hot_cache_max=0),
        supervisor=SupervisorConfig(heartbeat_interval=1.0, heartbeat_timeout=10.0, allow_drills=True,
                                    spare_workers=0),  # module doc: the runaway alone
        models=[ModelConfig(id="victim", path=str(model_dir), max_concurrency=1)],
    )
    arb = Arbiter(config, runtime, max_workers=4, http=False)
    task = asyncio.get_running_loop().create_task(arb.run())
    while not arb.running:
        await asyncio.sleep(0.01)
    samples = Samples(arb.endpoints.pub)
    await arb.models.load("victim")
    await asyncio.sleep(0.5)
    arb.wake()
    await asyncio.sleep(0.2)
    ceiling = last_tick(arb).usage + args.headroom
    arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=ceiling))
    if baseline:
        arb.pool.wake_on_watermark = False
        arb.enforcer.fixed_interval = 1.0
    results = []
    n = args.baseline_trials if baseline else args.trials
    for i in range(n):
        r = await trial(arb, samples, args.rate, args.to)
        if r:
            results.append(r)
            print(f"  {'1 s poll' if baseline else 'event   '} trial {i + 1:2d}: decision {r['decision_ms']:7.1f} ms, "
                  f"returned {r['returned_ms']:7.1f} ms, overshoot {r['overshoot']:.1%} ({r['action']})")
    arb.stop()
    await task
    return results


def summary(name: str, rs: list[dict]) -> None:
    dec = [r["decision_ms"] for r in rs]
    ret = [r["returned_ms"] for r in rs if r["returned_ms"] == r["returned_ms"]]  # drop NaN
    over = [r["overshoot"] for r in rs]
    rate = statistics.median(r["drill_rate"] for r in rs)
    returned = (f"memory returned p50 {pct(ret, 50):.1f} ms p99 {pct(ret, 99):.1f} ms"
                + (f" ({len(rs) - len(ret)} trial(s) not seen back under soft)" if len(ret) < len(rs) else "")
                if ret else "memory never seen back under soft")
    print(f"{name}: {len(rs)} trials; decision p50 {pct(dec, 50):.1f} ms p99 {pct(dec, 99):.1f} ms; "
          f"{returned}; overshoot max {max(over):.2%} mean {statistics.mean(over):.2%} of the ceiling; "
          f"drill grew at {format_size(int(rate))}/s (median)")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--baseline-trials", type=int, default=8)
    ap.add_argument("--rate", type=parse_size, default=parse_size("1GiB"), help="drill bytes per second")
    ap.add_argument("--headroom", type=parse_size, default=parse_size("1GiB"),
                    help="custom ceiling = usage at start + this")
    args = ap.parse_args()
    args.to = args.headroom * 3
    logging.basicConfig(level=logging.ERROR)
    from modelfiles.modelgen import make_model

    with tempfile.TemporaryDirectory(prefix="mv-react-") as tmp:
        model = Path(tmp) / "victim"
        make_model(model, 8 * MiB, 0)
        print(f"drill {format_size(args.rate)}/s in a busy non-pinned worker; ceiling = usage + "
              f"{format_size(args.headroom)}")
        fast = await run_mode(model, Path(tmp) / "rt1", args, baseline=False)
        slow = await run_mode(model, Path(tmp) / "rt2", args, baseline=True)
    summary("event-driven", fast)
    summary("1 s poll    ", slow)
    p_fast = pct([r["decision_ms"] for r in fast], 99)
    p_slow = pct([r["decision_ms"] for r in slow], 99)
    p50_ratio = pct([r["decision_ms"] for r in slow], 50) / max(1e-3, pct([r["decision_ms"] for r in fast], 50))
    print(f"speed-up at p50: {p50_ratio:.0f}x; at p99: {p_slow / max(1e-3, p_fast):.0f}x")
    print(f"reaction p99: {p_fast:.1f} ms (1 s poll: {p_slow:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
