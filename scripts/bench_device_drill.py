"""The fire drill on a discrete GPU: the guard acting on the device pool (SPEC D4).

A real supervisor runs one non-pinned model on a CUDA device under a custom
device ceiling a little above what the group holds there
(`[guard] custom_device_ceiling`); host RAM gets a generous custom ceiling, so
only the device pool can be the one under pressure. Each trial makes the
worker busy with a long generation, then starts a fire drill in it: real MLX
allocations at --rate, which on CUDA are device memory. The drill crosses the
device's soft and hard watermarks; the guard must answer on the device pool
(P6 step 3 there: abort the busy worker's requests, which ends the drill)
before the group goes over the device ceiling. Per trial, on CLOCK_MONOTONIC:

  decision   first sample whose device bytes reach the device hard watermark
             -> the decision carried out
  overshoot  peak device bytes above the device ceiling, as a share of it,
             from the worker's samples (MLX active + pool) and, where NVML
             gives per-process figures, from NVML polled every 5 ms

    python scripts/bench_device_drill.py [--trials 10] [--rate 4GiB] [--headroom 2GiB]

Runs only where a worker reports a CUDA device; elsewhere it says so and
exits 2. `--pretend-cuda` rehearses the whole path on a CPU machine: the
worker's hello is given a CUDA-shaped device_info (80 GiB), so the device
pool's rules run on MLX's CPU bytes; it checks the wiring, its figures are
not a GPU's. Last line: `device reaction p99: X ms; overshoot max Y`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_reaction import Samples, last_tick, pct  # noqa: E402

from shared import protocol as p  # noqa: E402
from shared.probe import nvml  # noqa: E402
from shared.sizes import GiB, MiB, format_size, parse_size  # noqa: E402
from supervisor.arbiter import Arbiter  # noqa: E402
from supervisor.config import Config, GuardConfig, ModelConfig, SupervisorConfig  # noqa: E402
from supervisor.policy import decisions as d  # noqa: E402
from supervisor.policy.pressure import TickResult  # noqa: E402

ACTIONS = (d.AbortWorkerRequests, d.Stop, d.MarkForUnload)


def on_device(s: p.Sample) -> int:
    """D1's fallback for one worker: MLX active + pool (device memory on CUDA)."""
    return s.memory.mlx_active + s.memory.mlx_pool


class NvmlPoller(threading.Thread):
    """NVML's per-process figure for one pid, every 5 ms: (t, bytes) pairs."""

    def __init__(self, pid: int, uuid: str | None) -> None:
        super().__init__(daemon=True)
        self.pid, self.uuid = pid, uuid
        self.points: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.005):
            reading = nvml.read_device(uuid=self.uuid)
            held = nvml.device_bytes_for(reading, self.pid)
            if held is not None:
                self.points.append((time.monotonic(), held))


async def settle(arb: Arbiter, seconds: float = 0.3) -> TickResult:
    """Wake the guard, wait, and return its latest tick."""
    arb.wake()
    await asyncio.sleep(seconds)
    return last_tick(arb)


PRETEND = {"device_name": "pretend", "architecture": "cpu", "total_memory": 80 * GiB, "free_memory": 80 * GiB}


async def load(arb: Arbiter, pretend: bool):
    handle = await arb.models.load("victim")
    if pretend:  # a CUDA-shaped hello; its free figure stays as the hello said (as D1's fallback)
        handle.set_device_info(dict(PRETEND))
    return handle


async def trial(arb: Arbiter, samples: Samples, rate: int, to: int, pretend: bool) -> dict | None:
    handle = await load(arb, pretend)
    stream = await arb.service.generate("victim", p.Generate(request_id="", prompt="tell me a long story",
                                                     max_tokens=3000))
    deadline = time.monotonic() + 10
    while not (handle.sample and handle.sample.running) and time.monotonic() < deadline:
        await settle(arb, 0.01)
    last = await settle(arb, 0.2)
    dc = last.device
    if dc is None:
        print("  trial: no device pool in the tick (no CUDA worker?)")
        return None
    snapshot = arb.enforcer.last_snapshot
    assert snapshot is not None  # set with `last`, on every tick
    mine_now = next((w.device_bytes for w in snapshot.workers
                     if w.worker == handle.worker_id), 0)
    others = last.device_usage - mine_now
    # the CUDA context NVML counts and MLX does not: the worker's samples plus this are
    # what the enforcer compares (NVML per process), measured before the drill grows
    before = handle.sample.memory if handle.sample else None
    context = max(0, mine_now - (before.mlx_active + before.mlx_pool)) if before else 0
    samples.drain()
    samples.items.clear()
    mark = len(arb.enforcer.executed)
    poller = NvmlPoller(handle.pid, str(handle.device_info.get("uuid") or "") or None)
    poller.start()
    start = time.monotonic()
    arb.pool.command(handle, p.Drill(rate=rate, to=to))
    while time.monotonic() - start < 15:
        await asyncio.sleep(0.002)
        samples.drain()
        if stream.done or not handle.live:
            break
    arb.pool.command(handle, p.DrillStop())
    if not stream.done:
        arb.service.cancel(stream)
    await asyncio.sleep(0.3)
    poller.stopped.set()
    poller.join()
    samples.drain()
    mine = [s for s in samples.items if s.worker_id == handle.worker_id and s.t >= start]
    # the first moment the group's device bytes reached the device hard watermark, from the
    # worker's samples (MLX bytes + context) or NVML's 5 ms polls, whichever saw it first
    crossings = [s.t for s in mine if on_device(s) + context + others >= dc.hard]
    crossings += [t for t, b in poller.points if t >= start and b + others >= dc.hard]
    actions = [(t, x) for t, x in list(arb.enforcer.executed)[mark:]
               if isinstance(x, ACTIONS) and x.worker == handle.worker_id]
    if not crossings or not actions:
        print(f"  trial: no hard crossing or no action (samples {len(mine)}, NVML points {len(poller.points)}, "
              f"actions {[(round((t - start) * 1000, 1), type(x).__name__) for t, x in actions]})")
        return None
    t_hard, t_decision = min(crossings), actions[0][0]
    peak = max(on_device(s) for s in mine) + context + others
    nvml_peak = max((b for _t, b in poller.points), default=0) + others
    for _ in range(500):  # the episode ends before the next trial
        if last_tick(arb).device_level == "ok" and not arb.pool.running(handle):
            break
        await settle(arb, 0.01)
    return {
        "decision_ms": (t_decision - t_hard) * 1000,
        "overshoot": max(0, peak - dc.ceiling) / dc.ceiling,
        "nvml_overshoot": max(0, nvml_peak - dc.ceiling) / dc.ceiling if poller.points else float("nan"),
        "action": type(actions[0][1]).__name__,
        "after_start_ms": (t_decision - start) * 1000,
        "reason": actions[0][1].reason,
        "ceiling": dc.ceiling,
    }


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--rate", type=parse_size, default=parse_size("4GiB"), help="drill bytes per second")
    ap.add_argument("--headroom", type=parse_size, default=parse_size("2GiB"),
                    help="custom device ceiling = the group's device bytes at start + this")
    ap.add_argument("--pretend-cuda", action="store_true",
                    help="rehearse on a CPU machine with a CUDA-shaped device_info (figures are not a GPU's)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from modelfiles.modelgen import make_model

    with tempfile.TemporaryDirectory(prefix="mv-devdrill-") as tmp:
        model = Path(tmp) / "victim"
        make_model(model, 8 * MiB, 0)
        config = Config(
            guard=GuardConfig(tier="custom", custom_ceiling=64 * GiB, hot_cache_max=0),
            supervisor=SupervisorConfig(heartbeat_interval=1.0, heartbeat_timeout=10.0, allow_drills=True),
            models=[ModelConfig(id="victim", path=str(model), max_concurrency=1)],
        )
        arb = Arbiter(config, Path(tmp) / "rt", max_workers=4, http=False)
        task = asyncio.get_running_loop().create_task(arb.run())
        while not arb.running:
            await asyncio.sleep(0.01)
        samples = Samples(arb.endpoints.pub)
        handle = await load(arb, args.pretend_cuda)
        last = await settle(arb, 0.5)
        if last.device is None:
            print(f"no CUDA device under the guard (worker device_info: {handle.device_info}); nothing to measure")
            arb.stop()
            await task
            return 2
        ceiling = last.device_usage + args.headroom
        arb.service.update_guard(p.GuardUpdate(custom_device_ceiling=ceiling))  # T6: applied by the tick it runs
        dc = (await settle(arb)).device
        if dc is None:
            raise RuntimeError("the device pool left the guard's tick after the ceiling was set")
        print(f"device {handle.device_info.get('device_name', '?')}: total {format_size(dc.total)}, group holds "
              f"{format_size(last.device_usage)}; custom device ceiling {format_size(dc.ceiling)} "
              f"(soft {format_size(dc.soft)}, hard {format_size(dc.hard)}); drill {format_size(args.rate)}/s")
        results = []
        for i in range(args.trials):
            r = await trial(arb, samples, args.rate, args.headroom * 3, args.pretend_cuda)
            if r:
                results.append(r)
                print(f"  trial {i + 1:2d}: decision {r['decision_ms']:7.1f} ms after the hard crossing "
                      f"({r['after_start_ms']:.0f} ms after the drill began), overshoot {r['overshoot']:.2%} "
                      f"(NVML {r['nvml_overshoot']:.2%}), {r['action']}: {r['reason']}")
        arb.stop()
        await task
    if not results:
        print("no trial crossed the device hard watermark with an action")
        return 1
    dec = [r["decision_ms"] for r in results]
    over = [r["overshoot"] for r in results]
    nv = [r["nvml_overshoot"] for r in results if r["nvml_overshoot"] == r["nvml_overshoot"]]
    print(f"{len(results)} trials; decision p50 {pct(dec, 50):.1f} ms p99 {pct(dec, 99):.1f} ms; overshoot "
          f"max {max(over):.2%} mean {statistics.mean(over):.2%} of the device ceiling"
          + (f"; NVML overshoot max {max(nv):.2%}" if nv else "; no NVML per-process figures"))
    print(f"device reaction p99: {pct(dec, 99):.1f} ms; overshoot max {max(over):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
