"""`watch`: follow a running supervisor's PUB socket.

For people: a live view (rich) of the ceiling and what binds it, the pressure
level against the watermarks, each worker's memory, and the guard's latest
events with their reasons. For scripts: `--json`, one object per message,
`{"topic": ..., "message": {...}}`.
"""

from __future__ import annotations

import collections
import json
import sys
import time

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from shared.vocab import GuardEventKind
from supervisor.cli.status import disk_budget
from supervisor.client import NotRunning, subscribe
from supervisor.policy.status import DiskCacheStatus, ServerStatus

# The events after which a worker's process is gone: its last sample leaves the view.
WORKER_GONE: frozenset[GuardEventKind] = frozenset({"exit", "crash"})


def add_arguments(parser):
    parser.add_argument("--topic", action="append", choices=p.TOPICS, help="only this topic (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object per message, for scripts")
    parser.add_argument("--count", type=int, default=0, help="stop after N messages (0: run until ^C)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="give up when no message arrives for this many seconds")
    parser.add_argument("--endpoint", default="",
                        help="a supervisor's PUB endpoint elsewhere, e.g. tcp://host:5556 (default: the local one)")
    parser.add_argument("--server-key", default="",
                        help="that endpoint's CURVE public key (Z85, from its endpoints.json pub_tcp_key)")


def run(args) -> int:
    if args.count < 0:
        print("memvisor: --count must be 0 or more", file=sys.stderr)
        return 2
    try:
        if args.json:
            return _json_lines(args)
        return _live(args)
    except NotRunning as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 3
    except TimeoutError as exc:
        print(f"memvisor: {exc}", file=sys.stderr)
        return 4


def _subscribe(args):
    return subscribe(args.runtime_dir, args.topic or [], timeout=args.timeout, endpoint=args.endpoint,
                     server_key=args.server_key)


def _json_lines(args) -> int:
    seen = 0
    for topic, msg in _subscribe(args):
        line = {"topic": topic, "message": msgspec.to_builtins(msg)}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        seen += 1
        if args.count and seen >= args.count:
            break
    return 0


class _View:
    def __init__(self) -> None:
        self.ceiling: p.CeilingMsg | None = None
        self.pressure: p.PressureMsg | None = None
        self.samples: dict[str, p.Sample] = {}
        self.events: collections.deque[p.GuardEvent] = collections.deque(maxlen=12)
        self.disk: DiskCacheStatus | None = None  # H5 (proposed): from the latest status message

    def take(self, msg) -> None:
        if isinstance(msg, p.CeilingMsg):
            self.ceiling = msg
        elif isinstance(msg, p.PressureMsg):
            self.pressure = msg
        elif isinstance(msg, p.Sample):
            self.samples[msg.worker_id] = msg
        elif isinstance(msg, p.GuardEvent):
            self.events.append(msg)
            if msg.kind in WORKER_GONE:
                self.samples.pop(msg.worker_id, None)
        elif isinstance(msg, p.StatusMsg):
            try:
                self.disk = msgspec.json.decode(msg.status, type=ServerStatus).disk_cache
            except msgspec.DecodeError:  # a newer or broken supervisor: keep the last good line
                pass

    def render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        parts = []
        c, pr = self.ceiling, self.pressure
        if c is not None:
            head = (f"tier [bold]{c.tier}[/]  ceiling [bold]{format_size(c.ceiling)}[/] "
                    f"(binding: [bold]{c.binding or '-'}[/])  static {format_size(c.static)}  "
                    f"dynamic {format_size(c.dynamic)}  gpu cap {format_size(c.gpu_cap)}  "
                    f"reserve {format_size(c.reserve)}" if c.enabled else "guard [bold red]off[/]")
            parts.append(head)
        if pr is not None:
            colour = {"ok": "green", "soft": "yellow", "hard": "red"}.get(pr.level, "white")
            width = 40
            fill = min(width, int(width * pr.utilization)) if pr.ceiling else 0
            bar = "█" * fill + "·" * (width - fill)
            parts.append(
                f"pressure [bold {colour}]{pr.level.upper()}[/]  [{colour}]{bar}[/] "
                f"{format_size(pr.usage)} / {format_size(pr.ceiling)} ({pr.utilization:.0%})  "
                f"soft {format_size(pr.soft_bytes)}  hard {format_size(pr.hard_bytes)}  "
                f"{'admission PAUSED  ' if pr.admission_paused else ''}tick {pr.interval:g}s"
            )
        device = (pr.device if pr is not None else None) or (c.device if c is not None else None)
        if device is not None:  # D6: the discrete device's pool under the host's
            parts.append(_device_line(device))
        if c is not None and c.hot_cache_max:  # H2: the group's caches against the budget
            cached = sum(s.memory.cache_bytes for s in self.samples.values())
            parts.append(f"prompt cache {format_size(cached)} / {format_size(c.hot_cache_max)} budget  "
                         f"reserved {format_size(c.hot_cache_reserved)}")
        if self.disk is not None and self.disk.max != 0:
            parts.append(_disk_line(self.disk))
        if not parts:
            parts.append("waiting for the supervisor's first tick ...")
        workers = Table("worker", "pid", "usage", "mlx active", "pool", "cache", "running", "queued",
                        "tokens", title="workers", expand=False)
        for s in sorted(self.samples.values(), key=lambda s: s.worker_id):
            m = s.memory
            workers.add_row(s.worker_id, str(s.pid), format_size(m.usage), format_size(m.mlx_active),
                            format_size(m.mlx_pool), format_size(m.cache_bytes), str(s.running),
                            str(s.queued), str(s.tokens))
        events = Table("time", "event", "model", "reason", title="guard events", expand=False)
        for e in self.events:
            events.add_row(time.strftime("%H:%M:%S", time.localtime(e.t)), e.kind, e.model_id or "-", e.reason)
        return Panel(Group(*parts, workers, events), title="memvisor watch", subtitle="^C to leave")


def _device_line(d: p.DevicePool, width: int = 40) -> str:
    """D6: the device pool's usage against its ceiling, level and binding (rich markup)."""
    name = f" {d.name}" if d.name else ""
    if d.ceiling <= 0:
        return f"device{name}  guard off: {format_size(d.usage)} of {format_size(d.total)}"
    colour = {"ok": "green", "soft": "yellow", "hard": "red"}.get(d.level, "white")
    fill = min(width, int(width * d.utilization))
    bar = "█" * fill + "·" * (width - fill)
    return (f"device{name} [bold {colour}]{d.level.upper()}[/]{' [bold red]EMERGENCY[/]' if d.emergency else ''}  "
            f"[{colour}]{bar}[/] {format_size(d.usage)} / {format_size(d.ceiling)} ({d.utilization:.0%})  "
            f"soft {format_size(d.soft_bytes)}  hard {format_size(d.hard_bytes)}  "
            f"binding: [bold]{d.binding or '-'}[/]  of {format_size(d.total)}")


def _disk_line(d: DiskCacheStatus) -> str:
    """H5 (proposed): the prompt cache's disk tier against its budget, and what the tier did since start."""
    line = (f"prompt cache on disk {format_size(d.bytes)} of {disk_budget(d)} budget, {d.entries} entries  "
            f"read back {d.read_entries} ({d.read_tokens} tokens)  written {d.written_entries}  "
            f"dropped {d.dropped_entries}  evicted {d.evicted_entries}")
    if d.quantize_bits:
        line += f"  quantized {d.quantized_entries} ({format_size(d.quantized_bytes)} returned)"
    return line


def _live(args) -> int:
    from rich.live import Live

    from supervisor.bus import Endpoints

    if not args.endpoint:
        Endpoints.load(args.runtime_dir)  # no supervisor: say so before drawing anything
    view = _View()
    seen = 0
    with Live(view.render(), refresh_per_second=8, screen=False) as live:
        try:
            for _topic, msg in _subscribe(args):
                view.take(msg)
                live.update(view.render())
                seen += 1
                if args.count and seen >= args.count:
                    break
        except KeyboardInterrupt:
            pass
    return 0
