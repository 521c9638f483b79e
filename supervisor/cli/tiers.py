"""`python -m supervisor tiers [--json]`: SPEC C14, every tier's ceiling now.

With any what-if flag nothing is read from this machine: counters not given
are absent (C2's fallbacks apply), sizes not given are 0 and the compressor
defaults to on. Without flags the probes read this machine.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from shared.host import HostCounters
from shared.sizes import GiB
from supervisor.cli._args import size_arg
from supervisor.policy.ceilings import TierPreview, tier_preview, wired_limit_advice

# flag -> help; the destination is the flag's name (HostCounters field or input)
_SIZE_FLAGS = {
    "--total": "machine memory (or container limit / budget)",
    "--free": "free memory",
    "--inactive": "inactive memory",
    "--file-backed": "file-backed pages (macOS external; Linux file pages)",
    "--active": "active memory",
    "--available": "available memory (used when free is not given)",
    "--own": "the guarded group's footprint",
    "--own-gpu": "the part of --own held by the GPU",
    "--gpu-cap": "the accelerator's allocation cap (raw)",
    "--custom-ceiling": "the custom tier's ceiling",
}
_COUNTERS = ("free", "inactive", "file_backed", "active", "available")


class WhatIf(msgspec.Struct, frozen=True, kw_only=True):
    host: HostCounters
    own: int = 0
    own_gpu: int = 0
    gpu_cap: int = 0
    custom_ceiling: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object for scripts")
    group = parser.add_argument_group("what-if inputs (any of them: read nothing from this machine)")
    for flag, text in _SIZE_FLAGS.items():
        group.add_argument(flag, type=size_arg, default=None, metavar="SIZE", help=text)
    group.add_argument("--compressor", choices=("on", "off"), default=None,
                       help="the OS can compress or swap anonymous memory (default on)")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def what_if(args: argparse.Namespace) -> WhatIf | None:
    """The what-if inputs, or None when no what-if flag was given."""
    given = {_dest(f): getattr(args, _dest(f)) for f in _SIZE_FLAGS}
    if all(v is None for v in given.values()) and args.compressor is None:
        return None
    host = HostCounters(
        total=given["total"] or 0,
        compressor=args.compressor != "off",
        **{k: given[k] for k in _COUNTERS},
    )
    return WhatIf(host=host, own=given["own"] or 0, own_gpu=given["own_gpu"] or 0,
                  gpu_cap=given["gpu_cap"] or 0, custom_ceiling=given["custom_ceiling"] or 0)


def read_machine() -> WhatIf:
    """This machine through shared.probe (imported only on this path)."""
    from shared import probe

    host = probe.read_host_counters()
    return WhatIf(host=host, own=probe.own_footprint() or 0)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


_COLUMNS = (
    ("tier", None), ("reserve", "reserve_bytes"), ("free", "free_bytes"),
    ("inactive", "inactive_bytes"), ("other apps", "other_apps_bytes"),
    ("static", "static_bytes"), ("dynamic", "dynamic_bytes"), ("gpu cap", "gpu_cap_bytes"),
    ("ceiling", "ceiling_bytes"), ("soft", "soft_bytes"), ("hard", "hard_bytes"),
    ("binding", "binding"),
)


def render_table(previews: dict[str, TierPreview], inputs: WhatIf) -> str:
    """A plain aligned table for people, sizes in GiB."""
    rows = [[name for name, _ in _COLUMNS]]
    for tier, p in previews.items():
        row = [tier]
        for _, field in _COLUMNS[1:]:
            value = getattr(p, field)
            row.append(value if isinstance(value, str) else _gib(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i in (0, len(row) - 1) else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    h = inputs.host
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(f"sizes in GiB; machine {_gib(h.total)} GiB, group footprint {_gib(inputs.own)} GiB, "
                 f"compressor {'on' if h.compressor else 'off'}")
    for tier, p in previews.items():
        if p.reserve_bytes >= h.total:
            lines.append(f"{tier} reserves more than the machine has: every model load would be refused")
    if previews["custom"].dynamic_bytes == 0:
        lines.append("custom: no custom ceiling set, so its ceiling is static / gpu cap only")
    advice = wired_limit_advice(previews["balanced"].static_bytes, h.total, inputs.gpu_cap)
    if advice:
        lines.append(advice)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    inputs = what_if(args)
    if inputs is None:
        try:
            inputs = read_machine()
        except ImportError as exc:
            print(f"tiers: cannot read this machine ({exc}); give what-if flags instead",
                  file=sys.stderr)
            return 2
    previews = tier_preview(inputs.host, inputs.own, inputs.own_gpu, inputs.gpu_cap,
                            inputs.custom_ceiling)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode({"tiers": previews}) + b"\n")
    else:
        print(render_table(previews, inputs))
    return 0
