"""`watch`: follow a running supervisor's PUB socket.

For people: a live view (rich) of the ceiling and what binds it, the pressure
level against the watermarks, each worker's memory, and the guard's latest
events with their reasons. For scripts: `--json`, one object per message,
`{"topic": ..., "message": {...}}`.

It starts with the recent events the supervisor keeps (SPEC S2's bounded
history, what `status` lists), so the view is never emptier than `status`:
they come first, as `event` messages (`"replayed": true` in `--json`), and
`--count` counts them. `--new` skips them and waits for what happens next. The
history is read over the control socket, so a `--endpoint` elsewhere has none.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from typing import Iterator

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from shared.vocab import GuardEventKind
from supervisor.cli._args import duration_arg
from supervisor.cli._control import connect
from supervisor.cli.status import disk_budget
from supervisor.policy.status import DiskCacheStatus, ServerStatus
from supervisor.wiring.client import NotRunning, subscribe

PANEL_EDGES = 4  # the panel's border and padding, each side

# The events after which a worker's process is gone: its last sample leaves the view.
WORKER_GONE: frozenset[GuardEventKind] = frozenset({"exit", "crash"})


def add_arguments(parser):
    parser.add_argument("--topic", action="append", choices=p.TOPICS, help="only this topic (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object per message, for scripts")
    parser.add_argument("--count", type=int, default=0,
                        help="stop after N messages, the replayed recent events included (0: run until ^C)")
    parser.add_argument("--new", action="store_true",
                        help="skip the recent events the supervisor kept; only what happens from now on")
    parser.add_argument("--timeout", type=duration_arg, default=None,
                        help="give up when no message arrives for this long: seconds, or e.g. 30s, 2m")
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


class _Recent(msgspec.Struct):
    """The part of the status reply `watch` replays (S2's history, most recent last)."""

    events: list[p.GuardEvent] = []


def _replays_history(args) -> bool:
    return not args.new and not args.endpoint and (not args.topic or "event" in args.topic)


def _recent_events(args) -> list[tuple[str, object]]:
    """The events the supervisor kept, asked over the control socket once the PUB socket
    is connected (so an event published meanwhile is in one or the other, or both)."""
    with connect(args.runtime_dir, timeout=args.timeout or 10.0) as client:
        reply = client.call(p.StatusRequest())
    if not isinstance(reply, p.ControlOk):
        return []
    try:
        return [("event", e) for e in msgspec.json.decode(reply.data, type=_Recent).events]
    except msgspec.DecodeError:  # a newer or broken supervisor: no history, the live stream still runs
        return []


def _event_key(msg: p.GuardEvent) -> tuple:
    return (msg.t, msg.kind, msg.worker_id, msg.model_id, msg.reason)


def _subscribe(args) -> Iterator[tuple[str, object, bool]]:
    """(topic, message, replayed): the recent events first, unless --new, then the live
    messages, less the events already replayed (both may hold one published as watch started)."""
    replayed: set[tuple] = set()
    pending = 0  # replayed messages `subscribe` has still to yield

    def history() -> list[tuple[str, object]]:
        nonlocal pending
        if not _replays_history(args):
            return []
        recent = _recent_events(args)
        replayed.update(_event_key(msg) for _, msg in recent if isinstance(msg, p.GuardEvent))
        pending = len(recent)
        return recent

    stream = subscribe(args.runtime_dir, args.topic or [], timeout=args.timeout, endpoint=args.endpoint,
                       server_key=args.server_key, first=history)
    for topic, msg in stream:
        if pending:
            pending -= 1
            yield topic, msg, True
        elif isinstance(msg, p.GuardEvent) and _event_key(msg) in replayed:
            replayed.discard(_event_key(msg))  # seen in the history already
        else:
            yield topic, msg, False


def _json_lines(args) -> int:
    seen = 0
    for topic, msg, replayed in _subscribe(args):
        line = {"topic": topic, "message": msgspec.to_builtins(msg)}
        if replayed:
            line["replayed"] = True
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

    def render(self, width: int = 80):
        from rich.console import Group
        from rich.panel import Panel

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
        return Panel(Group(*parts, self._workers(width), self._events()), title="memvisor watch",
                     subtitle="^C to leave")

    def _workers(self, width: int):
        """The workers' memory in `width` columns: the worker's name stays whole (a name cut to
        `demo-…` says nothing); pid, queue and tokens are left out first when it does not fit."""
        from rich.table import Column, Table

        samples = sorted(self.samples.values(), key=lambda s: s.worker_id)
        cells: list[tuple[str, list[str], bool]] = [  # header, cells, kept at any width
            ("worker", [s.worker_id for s in samples], True),
            ("pid", [str(s.pid) for s in samples], False),
            ("usage", [format_size(s.memory.usage) for s in samples], True),
            ("active", [format_size(s.memory.mlx_active) for s in samples], True),
            ("pool", [format_size(s.memory.mlx_pool) for s in samples], True),
            ("cache", [format_size(s.memory.cache_bytes) for s in samples], True),
            ("run", [str(s.running) for s in samples], True),
            ("queue", [str(s.queued) for s in samples], False),
            ("tokens", [str(s.tokens) for s in samples], False),
        ]
        need = {header: max([len(header), *(len(c) for c in column)]) + 2 for header, column, _ in cells}
        room = width - PANEL_EDGES - sum(need[h] for h, _, kept in cells if kept)
        shown = []
        for header, column, kept in cells:
            if not kept and need[header] > room:
                continue
            room -= 0 if kept else need[header]
            shown.append((header, column))
        table = Table(*(Column(h, no_wrap=True, min_width=need[h] - 2) for h, _ in shown), title="workers",
                      box=None, pad_edge=False, header_style="bold")
        for row in zip(*(column for _, column in shown)):
            table.add_row(*row)
        return table

    def _events(self):
        """The latest guard events; the model's name stays whole, the reason wraps."""
        from rich.table import Column, Table

        longest = max((len(e.model_id) for e in self.events), default=5)
        events = Table("time", "event", Column("model", no_wrap=True, min_width=longest), Column("reason", ratio=1),
                       title="guard events", box=None, pad_edge=False, header_style="bold")
        for e in self.events:
            events.add_row(time.strftime("%H:%M:%S", time.localtime(e.t)), e.kind, e.model_id or "-", e.reason)
        return events


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

    from supervisor.wiring.bus import Endpoints

    if not args.endpoint:
        Endpoints.load(args.runtime_dir)  # no supervisor: say so before drawing anything
    view = _View()
    seen = 0
    with Live(view.render(), refresh_per_second=8, screen=False) as live:
        try:
            for _topic, msg, _replayed in _subscribe(args):
                view.take(msg)
                live.update(view.render(live.console.width))
                seen += 1
                if args.count and seen >= args.count:
                    break
        except KeyboardInterrupt:
            pass
    return 0
