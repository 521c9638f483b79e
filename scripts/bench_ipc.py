"""The wire's cost: message codecs, ledger reads, sample ingest and command round trips.

    python scripts/bench_ipc.py [--samples 300000] [--pings 2000]

  codec       msgspec encode + decode of a Sample and a SetLimits, per message
  ledger      one worker's latest sample read from shared memory (seqlock + CRC)
  ingest      Samples/s the supervisor's Bus takes in over ipc:// (decoded and
              dispatched), pushed by another process as fast as it can
  round trip  Ping -> Pong between the supervisor and a real worker process
              (its step loop, with a generated model loaded), p50 and p99

Goals: ingest >= 100k samples/s; round trip p99 <= 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import multiprocess
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared import protocol as p  # noqa: E402
from shared.ledger import Ledger  # noqa: E402
from shared.limits import Limits  # noqa: E402
from shared.memory import MemoryReading
from shared.sizes import MiB  # noqa: E402
from supervisor.wiring.bus import Bus, Endpoints  # noqa: E402

READING = MemoryReading(usage=4, footprint=4, mlx_active=1, mlx_pool=2, mlx_peak=3)


def sample(i: int = 0) -> p.Sample:
    return p.Sample(worker_id="model#1", model_id="model", pid=1234, seq=i, t=time.monotonic(),
                    memory=MemoryReading(usage=146 * MiB, footprint=150 * MiB, mlx_active=123 * MiB,
                                         mlx_pool=4 * MiB, mlx_peak=130 * MiB),
                    running=2, queued=1, tokens=5000)


def bench_codec() -> None:
    bench_one_codec("Sample", p.WorkerReport, sample())
    bench_one_codec("SetLimits", p.CommandMsg, p.SetLimits(cmd=1, limits=Limits(hard_limit=1)))


def bench_one_codec(name: str, union: Any, msg: p.Msg) -> None:
    codec = p.Codec(union)
    frame = codec.encode(msg)
    n = 200_000
    enc = timeit.timeit(lambda: codec.encode(msg), number=n) / n * 1e6
    dec = timeit.timeit(lambda: codec.decode(frame), number=n) / n * 1e6
    print(f"codec {name:9s}: encode {enc:.2f} µs, decode {dec:.2f} µs ({len(frame)} bytes)")


def bench_ledger(tmp: Path) -> None:
    led = Ledger.create(tmp / "ledger", 64)
    for slot in range(8):
        led.write_sample(slot, pid=100 + slot, t=1.0, memory=READING)
    n = 100_000
    read = timeit.timeit(lambda: led.read_sample(3), number=n) / n * 1e6
    write = timeit.timeit(lambda: led.write_sample(3, pid=103, t=1.0, memory=READING), number=n) / n * 1e6
    group = timeit.timeit(led.group_usage, number=5_000) / 5_000 * 1e6
    print(f"ledger: read one worker's sample {read:.2f} µs, write {write:.2f} µs, "
          f"group usage over 64 slots (8 live) {group:.1f} µs")
    led.close()


def _pusher(endpoint: str, n: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    codec = p.Codec(p.WorkerReport)
    frames = [codec.encode(sample(i)) for i in range(1000)]
    time.sleep(0.3)
    for i in range(n):
        s.send(frames[i % 1000])
    s.close(linger=-1)
    ctx.term()


async def bench_ingest(tmp: Path, n: int) -> float:
    ctx = zmq.Context()
    bus = Bus(ctx, Endpoints.in_dir(tmp))
    bus.reports.setsockopt(zmq.RCVHWM, 0)
    got = {"n": 0, "first": 0.0, "last": 0.0}
    done = asyncio.get_running_loop().create_future()

    def on_report(msg) -> None:
        if got["n"] == 0:
            got["first"] = time.perf_counter()
        got["n"] += 1
        if got["n"] == n:
            got["last"] = time.perf_counter()
            done.set_result(None)

    bus.attach(asyncio.get_running_loop(), lambda *_: None, on_report, lambda *_: None)
    proc = multiprocess.get_context("spawn").Process(target=_pusher, args=(bus.endpoints.reports, n))
    proc.start()
    await asyncio.wait_for(done, 120)
    proc.join()
    bus.close()
    ctx.term()
    rate = (n - 1) / (got["last"] - got["first"])
    print(f"ingest: {n} samples decoded and dispatched at {rate / 1000:.0f}k samples/s")
    return rate


async def bench_round_trip(tmp: Path, pings: int) -> tuple[float, float]:
    from modelfiles.modelgen import make_model
    from supervisor.arbiter import Arbiter
    from supervisor.config import Config, ModelConfig, SupervisorConfig

    make_model(tmp / "m", 2 * MiB, 0)
    config = Config(supervisor=SupervisorConfig(heartbeat_interval=30, heartbeat_timeout=60),
                    models=[ModelConfig(id="m", path=str(tmp / "m"))])
    arb = Arbiter(config, tmp / "rt", max_workers=4, http=False)
    task = asyncio.get_running_loop().create_task(arb.run())
    while not arb.running:
        await asyncio.sleep(0.01)
    handle = await arb.models.load("m")
    for _ in range(200):  # warm up
        await arb.pool.watchdog.ping(handle)
    rtts = sorted([await arb.pool.watchdog.ping(handle) for _ in range(pings)])
    arb.stop()
    await task
    p50, p99 = rtts[len(rtts) // 2] * 1e3, rtts[int(len(rtts) * 0.99)] * 1e3
    print(f"round trip: Ping -> Pong with a real idle worker, {pings} pings: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    return p50, p99


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300_000)
    ap.add_argument("--pings", type=int, default=2000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="mv-ipc-") as tmp_name:
        tmp = Path(tmp_name)
        bench_codec()
        bench_ledger(tmp)
        (tmp / "bus").mkdir()
        rate = await bench_ingest(tmp / "bus", args.samples)
        _p50, p99 = await bench_round_trip(tmp, args.pings)
    print(f"ipc: ingest {rate / 1000:.0f}k samples/s, round trip p99 {p99:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
