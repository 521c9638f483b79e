"""Does GET /v1/events slow the guard down? Reaction to a drill with 0 and with 50 slow SSE clients.

One real supervisor (HTTP front door on, one non-pinned model under a custom
ceiling a little above what it uses) runs bench_reaction's trial: the worker
is made busy, a fire drill grows real MLX allocations, and we measure the
guard's decision latency (first sample at or over the hard watermark -> the
decision sent, on the monotonic clock the worker and supervisor share).

The trials alternate, in rounds, between no event-stream client and 50 slow
ones connected from another process: half never read a byte (their queues fill,
they are dropped, their sockets stay open until the write timeout), half
read 2 KiB a second and reconnect whenever the server ends their stream, so
the load stays on for the whole phase. Each asks for every topic and the
whole history (`?since=0`). Same supervisor, same run: compare the ratio,
not the absolute figures (the machine is shared).

    python scripts/bench_events.py [--trials 12] [--rounds 3] [--clients 50] [--rate 512MiB] [--headroom 512MiB]

Last line: `decision p50 X ms with 50 slow SSE clients vs Y ms with none (ratio R)`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_reaction import Samples, last_tick, pct, trial  # noqa: E402

from shared import protocol as p  # noqa: E402
from shared.sizes import MiB, format_size, parse_size  # noqa: E402
from supervisor.arbiter import Arbiter  # noqa: E402
from supervisor.config import Config, GuardConfig, ModelConfig, SupervisorConfig  # noqa: E402

# ---------------------------------------------------------------------------
# the slow clients (run in their own process: `bench_events.py --clients-only PORT N`)


def slow_clients(port: int, count: int) -> None:
    """Half never read; half read 2 KiB/s and reconnect when their stream ends."""
    request = b"GET /v1/events?since=0 HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"

    def connect() -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # back-pressure reaches the server soon
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        sock.setblocking(False)
        return sock

    silent = [connect() for _ in range(count // 2)]
    readers = [connect() for _ in range(count - count // 2)]
    reconnects = 0
    print(f"connected {len(silent)} silent and {len(readers)} slow readers", flush=True)
    while True:
        time.sleep(1.0)
        for i, sock in enumerate(readers):
            try:
                data = sock.recv(2048)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the server ended the stream (dropped): come back, as EventSource does
                sock.close()
                readers[i] = connect()
                reconnects += 1
        if silent[0].fileno() < 0:
            break


# ---------------------------------------------------------------------------
# the supervisor and the trials


async def start(model_dir: Path, runtime: Path, headroom: int) -> tuple[Arbiter, asyncio.Task]:
    config = Config(
        # hot_cache_max=0: the bench measures event fan-out, not the prompt cache (as bench_reaction;
        # C12's old used + 512 MiB reservation also left 1-byte limits here)
        guard=GuardConfig(tier="custom", custom_ceiling=0, hot_cache_max=0),
        supervisor=SupervisorConfig(http="127.0.0.1:0", heartbeat_interval=1.0, heartbeat_timeout=10.0,
                                    allow_drills=True),
        models=[ModelConfig(id="victim", path=str(model_dir), max_concurrency=1)],
    )
    arb = Arbiter(config, runtime, max_workers=4, http=True)
    task = asyncio.get_running_loop().create_task(arb.run())
    while not arb.http_address:
        await asyncio.sleep(0.01)
    await arb.models.load("victim")
    await asyncio.sleep(0.5)
    arb.wake()
    await asyncio.sleep(0.2)
    arb.enforcer.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=last_tick(arb).usage + headroom))
    return arb, task


class PublishTimer:
    """Time spent handing each PUB message to the SSE hub (the guard's only cost)."""

    def __init__(self, arb: Arbiter) -> None:
        self.hub_publish = arb.hub.publish
        self.calls = 0
        self.seconds = 0.0
        arb.bus.listeners[:] = [self.publish]

    def publish(self, msg) -> None:
        t0 = time.perf_counter()
        self.hub_publish(msg)
        self.seconds += time.perf_counter() - t0
        self.calls += 1

    def mean_us(self) -> float:
        return self.seconds / max(1, self.calls) * 1e6

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


class Mode:
    """The trials of one mode (0 or N clients) across the rounds, and what the hub did meanwhile."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.results: list[dict] = []
        self.subscribers: list[int] = []
        self.publish_calls = 0
        self.publish_seconds = 0.0

    async def run(self, arb: Arbiter, samples: Samples, args, timer: PublishTimer, trials: int) -> None:
        timer.reset()
        for _ in range(trials):
            self.subscribers.append(len(arb.hub.subscribers))
            r = await trial(arb, samples, args.rate, args.rate * 4)
            if r:
                self.results.append(r)
                print(f"  {self.name} trial {len(self.results):2d}: decision {r['decision_ms']:7.1f} ms, "
                      f"returned {r['returned_ms']:7.1f} ms, overshoot {r['overshoot']:.1%} ({r['action']}); "
                      f"{self.subscribers[-1]} SSE subscribers attached")
        self.publish_calls += timer.calls
        self.publish_seconds += timer.seconds

    def summary(self, arb: Arbiter) -> None:
        dec = [r["decision_ms"] for r in self.results]
        if dec:
            print(f"{self.name}: {len(dec)} trials; decision p50 {pct(dec, 50):.1f} ms p99 {pct(dec, 99):.1f} ms; "
                  f"hub publish {self.publish_seconds / max(1, self.publish_calls) * 1e6:.1f} us/message over "
                  f"{self.publish_calls} messages; SSE subscribers attached {min(self.subscribers)}.."
                  f"{max(self.subscribers)}; clients dropped {arb.hub.dropped} in all")

    def p(self, q: float) -> float:
        return pct([r["decision_ms"] for r in self.results], q)


async def with_clients(arb: Arbiter, port: int, count: int) -> subprocess.Popen:
    clients = subprocess.Popen([sys.executable, __file__, "--clients-only", str(port), str(count)],
                               stdout=subprocess.PIPE, text=True)
    print("  " + (clients.stdout.readline().strip() if clients.stdout else ""))
    deadline = time.monotonic() + 10
    while len(arb.hub.subscribers) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    return clients


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12, help="trials per mode, split over the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two modes")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rate", type=parse_size, default=parse_size("512MiB"), help="drill bytes per second")
    ap.add_argument("--headroom", type=parse_size, default=parse_size("512MiB"),
                    help="custom ceiling = usage at start + this")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from modelfiles.modelgen import make_model

    with tempfile.TemporaryDirectory(prefix="mv-events-") as tmp:
        model = Path(tmp) / "victim"
        make_model(model, 8 * MiB, 0)
        print(f"drill {format_size(args.rate)}/s in a busy non-pinned worker; ceiling = usage + "
              f"{format_size(args.headroom)}; {args.clients} slow SSE clients in the second phase")
        arb, task = await start(model, Path(tmp) / "rt", args.headroom)
        samples = Samples(arb.endpoints.pub)
        timer = PublishTimer(arb)
        port = int(arb.http_address.rsplit(":", 1)[1])
        quiet, busy = Mode("0 clients "), Mode(f"{args.clients} clients")
        per_round = max(1, args.trials // args.rounds)
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits both modes alike
            await quiet.run(arb, samples, args, timer, per_round)
            clients = await with_clients(arb, port, args.clients)
            try:
                await busy.run(arb, samples, args, timer, per_round)
            finally:
                clients.kill()
                clients.wait()
            while arb.hub.subscribers:  # the server notices the closed sockets
                await asyncio.sleep(0.05)
        quiet.summary(arb)
        busy.summary(arb)
        arb.stop()
        await task
    if not quiet.results or not busy.results:
        print("not enough trials with a decision to compare")
        return 1
    print(f"decision p99: {busy.p(99):.1f} ms with {args.clients} slow SSE clients, {quiet.p(99):.1f} ms with none")
    print(f"decision p50 {busy.p(50):.1f} ms with {args.clients} slow SSE clients vs {quiet.p(50):.1f} ms with none "
          f"(ratio {busy.p(50) / max(1e-3, quiet.p(50)):.2f})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--clients-only":
        slow_clients(int(sys.argv[2]), int(sys.argv[3]))
        raise SystemExit(0)
    raise SystemExit(asyncio.run(main()))
