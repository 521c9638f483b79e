"""`status [--json]`: the guard's status (SPEC S1) and the workers of a running supervisor."""

from __future__ import annotations

import sys
import time

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from supervisor.cli._args import duration_arg
from supervisor.cli._control import connect
from supervisor.policy.status import DiskCacheStatus, GuardStatus, ServerStatus, WorkerStatus
from supervisor.policy.wired import wiring_line
from supervisor.wiring.client import NotRunning


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="the whole status as one JSON object")
    parser.add_argument("--timeout", type=duration_arg, default=10.0,
                        help="how long to wait for the supervisor: seconds, or e.g. 90s, 2m (default 10)")


def run(args) -> int:
    try:
        with connect(args.runtime_dir, timeout=args.timeout) as client:
            reply = client.call(p.StatusRequest())
    except NotRunning as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 3
    if isinstance(reply, p.ControlError):
        print(f"memvisor: {reply.message}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(reply.data.decode() + "\n")
        return 0
    print(render(msgspec.json.decode(reply.data, type=ServerStatus)))
    return 0


def render(st: ServerStatus) -> str:
    g = st.guard
    size = format_size
    lines = [
        f"memvisor pid {st.pid}, up {st.uptime:.0f} s, runtime dir {st.runtime_dir}",
        f"  http {st.http or '-'}   pub {st.pub}",
        "",
    ]
    if not g.enabled:
        lines.append("guard: OFF (no limit; loads still evict idle models to fit the static ceiling)")
    else:
        lines += [
            f"guard: tier {g.tier}, ceiling {size(g.ceiling)} bound by {g.binding}"
            + (f" — to raise it: {g.remedy}" if g.remedy else ""),
            f"  static {size(g.static)}  dynamic {size(g.dynamic)}  gpu cap {size(g.gpu_cap)}"
            f" (raw {size(g.gpu_cap_raw)})  reserve {size(g.reserve)} of {size(g.total)}",
            f"  usage {size(g.usage)} = {g.utilization:.0%} of the ceiling;"
            f" soft {size(g.soft_bytes)} ({g.soft_threshold:g}), hard {size(g.hard_bytes)} ({g.hard_threshold:g})",
            f"  pressure {g.pressure_level.upper()}{' EMERGENCY' if g.emergency else ''}"
            f"{' (the worse of host and device)' if g.device is not None else ''}"
            f"{', admission paused' if g.admission_paused else ''}; next check in {g.poll_interval:g} s",
        ]
    if g.warning:
        lines.append(f"  warning: {g.warning}")
    lines += _wired_lines(g)
    budget = (f"{size(g.hot_cache_budget)} budget in force (hot_cache_max {size(g.hot_cache_max)}, at most "
              "a quarter of soft)" if g.hot_cache_budget != g.hot_cache_max else f"{size(g.hot_cache_max)} budget")
    lines.append(f"  prompt cache {size(g.hot_cache_used)} of {budget}"
                 f" (reserved off the other workers' limits: {size(g.hot_cache_reserved)})"
                 if g.hot_cache_max else "  prompt cache off (hot_cache_max = 0)")
    lines += _disk_cache_lines(st.disk_cache)
    if g.device is not None:
        lines += _device_lines(g.device, g.enabled)
    dev = g.device is not None  # D6: a device column beside usage
    name = max(19, *(len(m.id) for m in st.models)) if st.models else 19  # a model's name is never cut
    lines += ["", f"{'model':<{name + 1}} {'state':<10} {'pid':>7} {'usage':>10} " + (f"{'device':>10} " if dev else "")
              + f"{'mlx active':>10} {'pool':>9} {'cache':>9} {'disk':>9} {'batch':>9} {'run':>4} {'queue':>5} "
              f"{'idle':>7} "
              f"{'restarts':>8}"]
    workers = {w.model: w for w in g.workers if w.state not in ("stopped", "dead")}
    for m in st.models:
        w = workers.get(m.id)
        pin = "*" if m.pinned else " "
        if w is None:
            on_disk = f"  {size(m.disk_cache_bytes)} of prompt cache on disk" if m.disk_cache_bytes else ""
            lines.append(f"{pin}{m.id:<{name}} {m.state:<10}" + (f"  {m.failed_reason}" if m.failed_reason else "")
                         + on_disk)
            continue
        lines.append(
            f"{pin}{m.id:<{name}} {w.state:<10} {w.pid:>7} {size(w.usage):>10} "
            + (f"{size(w.device_bytes):>10} " if dev else "") + f"{size(w.mlx_active):>10} "
            f"{size(w.mlx_pool):>9} {size(w.cache_bytes):>9} {size(m.disk_cache_bytes):>9} {size(w.batch_bytes):>9} "
            f"{w.running:>4} {w.queued:>5} {w.idle_seconds:>6.0f}s {w.restarts:>8}"
        )
    for w in g.workers:  # W1: spare workers, MLX imported and no model yet
        if not w.model and w.state not in ("stopped", "dead"):
            lines.append(f" {'(spare)':<{name}} {w.state:<10} {w.pid:>7} "
                         f"{size(w.usage):>10}")
    lines.append("(* pinned)")
    lines += _batch_lines([workers[m.id] for m in st.models if m.id in workers])
    if st.events:
        lines += ["", "recent guard events:"]
        for e in st.events[-8:]:
            when = time.strftime("%H:%M:%S", time.localtime(e.t))
            who = f" {e.model_id}" if e.model_id else ""
            lines.append(f"  {when} {e.kind}{who}: {e.reason}")
    if st.malformed_frames:
        lines.append(f"\n{st.malformed_frames} malformed frame(s) refused since start")
    return "\n".join(lines)


def _wired_lines(g: GuardStatus) -> list[str]:
    """M2, M3 (macOS): whether workers wire memory, how to raise a low kernel cap, what exits stranded."""
    line = wiring_line(g.wire_weights, sys.platform == "darwin")
    lines = [f"  {line}"] if line else []
    if g.wired_advice:
        lines.append(f"  wiring: {g.wired_advice}")
    if g.wired_stranded:
        lines.append(f"  wired memory stranded by worker exits: {format_size(g.wired_stranded)}, counted as other "
                     "apps' memory (off the static ceiling and the GPU cap) until the OS returns it")
    return lines


def disk_budget(d: DiskCacheStatus) -> str:
    """The disk tier's budget as people read it: the one in force, else what the config asks."""
    return format_size(d.budget) if d.budget else ("auto" if d.max < 0 else format_size(d.max))


def _disk_cache_lines(d: DiskCacheStatus) -> list[str]:
    """H5, H6 (proposed): the prompt cache's disk tier, and what shrink before drop returned."""
    size = format_size
    if d.max == 0:
        lines = ["  prompt cache on disk: off (disk_cache_max = 0)"]
    else:
        lines = [f"  prompt cache on disk {size(d.bytes)} of {disk_budget(d)} budget, {d.entries} entries"
                 f" (a stop writes for up to {d.grace:g} s)",
                 f"    read back {d.read_entries} ({size(d.read_bytes)}, {d.read_tokens} tokens);"
                 f" written {d.written_entries} ({size(d.written_bytes)}); not written, a stop's deadline first:"
                 f" {d.dropped_entries}; evicted over the budget {d.evicted_entries}"]
    if d.quantize_bits or d.quantized_entries:
        lines.append(f"  shrink before drop: {d.quantize_bits or 'off'}-bit, {d.quantized_entries} entries quantized,"
                     f" {size(d.quantized_bytes)} returned")
    return lines


def _batch_lines(workers: list[WorkerStatus]) -> list[str]:
    """Where each decode batch's memory goes: buffers against live KV, copies, pool returns."""
    size = format_size
    out = []
    for w in workers:
        if not (w.batch_bytes or w.batch_relayouts or w.pool_returns):
            continue
        held = (f"{size(w.batch_bytes)} of KV buffers for {size(w.batch_live_bytes)} of live KV"
                + (f" ({w.batch_bytes / w.batch_live_bytes:.2f}x)" if w.batch_live_bytes else "")
                if w.batch_bytes else "no decode batch now")
        line = f"  {w.model}: {held}, {w.batch_relayouts} relayout(s) since start"
        if w.pool_returns:
            line += (f"; pool over its cap returned by the worker {w.pool_returns} time(s), "
                     f"{size(w.pool_returned)} in all")
        out.append(line)
    return ["", "decode batches (buffers as allocated, live KV in them):", *out] if out else []


def _device_lines(d: p.DevicePool, enabled: bool) -> list[str]:
    """D6: the discrete device's pool, beside the host's block above."""
    size = format_size
    name = f" {d.name}" if d.name else ""
    free = "free unknown" if d.free is None else f"free {size(d.free)}"
    head = [f"device{name}: {size(d.total)}, {free}, other processes {size(d.others)}"]
    if not enabled:
        return head + [f"  guard OFF: no device limit; usage {size(d.usage)}, loads still fit the device "
                       f"static ceiling {size(d.static)}"]
    lines = head + [
        f"  device ceiling {size(d.ceiling)} bound by {d.binding}" + (f" — to raise it: {d.remedy}" if d.remedy else ""),
        f"  static {size(d.static)}  dynamic {size(d.dynamic)}  reserve {size(d.reserve)} of {size(d.total)}",
        f"  usage {size(d.usage)} = {d.utilization:.0%} of the device ceiling;"
        f" soft {size(d.soft_bytes)} ({d.soft_threshold:g}), hard {size(d.hard_bytes)} ({d.hard_threshold:g})",
        f"  device pressure {d.level.upper()}{' EMERGENCY' if d.emergency else ''}",
    ]
    if d.reserve_exceeds_total:
        lines.append(f"  warning: the tier reserves {size(d.reserve)} of device memory but the device has only "
                     f"{size(d.total)}; every model load is refused")
    return lines
