"""Where a served token's time goes: each process's CPU per token, and py-spy's shares of it.

scripts/bench_path.py's `--profile DIR`: the server layer runs rounds for
`seconds` while py-spy samples the worker and the supervisor (raw collapsed
stacks into DIR) and `perf stat` counts their context switches. Printed per
process: its CPU per token over those rounds (the worker's by thread), the
context switches per token, and each part's share of the samples.

Read the shares with care on a loaded machine: py-spy (`--nonblocking`,
idle threads dropped) samples a thread that is running or waiting for a
CPU, so a call that wakes another thread and loses the CPU to it (a ZeroMQ
send wakes the I/O thread) collects samples out of proportion to its own
instructions. py-spy sees Python threads only: MLX's evaluation thread and
ZeroMQ's I/O thread show as CPU alone. The first PARTS entry whose mark a
sample's stack holds names its part, so the list goes from the most
specific mark to the least.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

WORKER_PARTS = (  # (part, substring of a frame)
    ("emit: detokenize", "StreamingDetokenizer"),
    ("emit: detokenize", "segment (worker/decode.py"),
    ("emit: stop strings, logprobs, events", "DecodeStep.emit"),
    ("emit: stop strings, logprobs, events", "DecodeStep._token"),
    ("emit: ended rows' KV kept (H1)", "DecodeStep._store"),
    ("read the step's tokens (waits for MLX)", "DecodeBatch.tokens"),
    ("decode step: graph build (model call)", "DecodeBatch.forward"),
    ("decode step: graph build (model call)", "DecodeStep._single"),
    ("decode step: join/leave rows", "DecodeBatch."),
    ("decode step: other", "DecodeStep."),
    ("prefill", "Prefill"),
    ("scheduler, engine step", "Engine.step"),
    ("frames: coalesce, encode, send", "coalesce"),
    ("frames: coalesce, encode, send", "Wire.reply"),
    ("commands: poll, receive, obey", "Worker.take_commands"),
    ("memory reading, ledger, limits", "Readings."),
    ("memory reading, ledger, limits", "read_limits"),
    ("memory reading, ledger, limits", "AllocatorLimits"),
    ("prompt cache tiers", "CacheTiers"),
    ("step boundary (pool, drill, reclaims)", "Worker.step_boundary"),
    ("heartbeat thread", "Heartbeat.run"),
    ("loop: other", "Worker.loop"),
)
SUPERVISOR_PARTS = (
    ("HTTP: socket write (loopback TCP, in the kernel)", "_SelectorSocketTransport.write"),
    ("HTTP: uvicorn/h11 framing", "h11"),
    ("HTTP: Instrumented, Starlette send chain", "tracked"),
    ("HTTP: Instrumented, Starlette send chain", "_send"),
    ("HTTP: Instrumented, Starlette send chain", "sender"),
    ("SSE: chunk rendering (openai.py)", "Completion."),
    ("job: next_message, pieces, metrics (job.py)", "Job.next_message"),
    ("job: next_message, pieces, metrics (job.py)", "Job.pieces"),
    ("SSE: body joins, Starlette's response loop", "Job.sse_body"),
    ("SSE: body joins, Starlette's response loop", "StreamingResponse"),
    ("tokens routed to streams (deliver, queue)", "Streams.deliver"),
    ("tokens routed to streams (deliver, queue)", "RequestStream.put"),
    ("ZeroMQ: receive, decode (bus)", "Bus."),
    ("guard: enforcer, policy, pool", "Enforcer."),
    ("guard: enforcer, policy, pool", "Pool."),
    ("events hub (fanout)", "Hub."),
    ("asyncio: select, wake-ups", "EpollSelector.select"),
    ("asyncio: select, wake-ups", "_run_once"),
)


def shares(path: Path, parts: tuple[tuple[str, str], ...]) -> tuple[dict[str, float], int]:
    """Each part's share of the samples in a raw collapsed-stack file, and how many samples."""
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        part = next((label for label, mark in parts if mark in stack), "other")
        counts[part] = counts.get(part, 0) + int(count)
    return {part: n / max(1, total) for part, n in counts.items()}, total


class Recorder:
    """py-spy and perf stat on the server's processes while rounds run."""

    def __init__(self, pids: dict[str, int], out: Path, n: int, rate: int) -> None:
        spy = Path(sys.executable).with_name("py-spy")
        if not spy.exists():  # a venv's own, else one on PATH (a --target install, as on a lent GPU)
            spy = Path(shutil.which("py-spy") or spy)
        if not spy.exists():
            raise SystemExit("--profile needs py-spy in this venv or on PATH (pip install py-spy: a dev tool)")
        self.files = {name: out / f"{name}-{n}.txt" for name in pids}
        self.perf = {name: out / f"{name}-{n}.perf" for name in pids}
        self.procs = [subprocess.Popen([str(spy), "record", "-p", str(pid), "-r", str(rate), "-f", "raw",
                                        "--nonblocking", "-o", str(self.files[name])],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for name, pid in pids.items()]
        if shutil.which("perf"):
            self.procs += [subprocess.Popen(["perf", "stat", "-x,", "-e", "task-clock,context-switches", "-p",
                                             str(pid), "-o", str(self.perf[name])],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                           for name, pid in pids.items()]
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(2)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    def switches(self, name: str) -> int | None:
        """perf stat's context switches of process `name`, when perf ran."""
        try:
            for row in self.perf[name].read_text().splitlines():
                fields = row.split(",")
                if len(fields) > 2 and fields[2] == "context-switches" and fields[0].isdigit():
                    return int(fields[0])
        except OSError:
            pass
        return None


def profiled(server: Any, n: int, tokens: int, out: Path, seconds: float, rate: int,
             run_round: Callable[[int, int], Any], cpu_of: Callable[[], Any]) -> None:
    """Rounds of n streams for `seconds` under py-spy; the microseconds per token of each part."""
    out.mkdir(parents=True, exist_ok=True)
    pids = {"worker": server.worker_pid, "supervisor": server.server.proc.pid}
    recorder = Recorder(pids, out, n, rate)
    cpu = cpu_of()
    cpu.start()
    count, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        count += run_round(n, tokens).tokens
    per_token = cpu.per_token(count)
    recorder.stop()
    print(f"    profile @{n}: {count} tokens in {time.monotonic() - started:.1f} s; per process: CPU us per token, "
          "then each part's share of py-spy's samples (running or runnable time):", flush=True)
    rows = [(f"worker main thread ({per_token.get('worker.main', 0.0) * 1e6:.0f} us)", "worker", WORKER_PARTS),
            (f"supervisor ({per_token.get('supervisor', 0.0) * 1e6:.0f} us)", "supervisor", SUPERVISOR_PARTS)]
    for title, name, parts in rows:
        got, samples = shares(recorder.files[name], parts)
        switches = recorder.switches(name)
        cs = "" if switches is None else f", {switches / max(1, count):.2f} context switches per token"
        detail = "; ".join(f"{part} {share:.1%}" for part, share in sorted(got.items(), key=lambda x: -x[1])
                           if share >= 0.005)
        print(f"      {title} ({samples} samples{cs}): {detail}", flush=True)
    rest = {k: v * 1e6 for k, v in per_token.items() if k.startswith("worker.") and k != "worker.main"}
    print("      worker's other threads (no Python stacks): "
          + "; ".join(f"{k[7:]} {v:.1f}" for k, v in sorted(rest.items(), key=lambda x: -x[1]) if v >= 0.5)
          + f" (\"other\" is MLX's evaluation thread and the heartbeat); the client {per_token.get('bench', 0) * 1e6:.1f}",
          flush=True)
