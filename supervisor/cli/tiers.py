"""`python -m supervisor tiers [--json]`: SPEC C14, every tier's ceiling now.

With any what-if flag nothing is read from this machine: counters not given
are absent (C2's fallbacks apply), sizes not given are 0 and the compressor
defaults to on. Without flags the probes read this machine.

With a discrete device (NVML's device 0, or `--device-total`) a second table
shows every tier's device ceiling beside the host's (SPEC D6, C14's shape);
without one the output is the host table alone.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from shared.host import HostCounters
from shared.sizes import GiB
from supervisor.cli._args import size_arg
from supervisor.policy.ceilings import TierPreview, tier_preview, wired_limit_advice
from supervisor.policy.device import DeviceTierPreview, device_tier_preview

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
    "--device-total": "a discrete device's memory (0 or absent: no device pool)",
    "--device-free": "free memory on that device (absent: unknown, device dynamic = static)",
    "--device-own": "the guarded group's device bytes",
    "--custom-device-ceiling": "the custom tier's device ceiling",
}
_COUNTERS = ("free", "inactive", "file_backed", "active", "available")


class WhatIf(msgspec.Struct, frozen=True, kw_only=True):
    host: HostCounters
    own: int = 0
    own_gpu: int = 0
    gpu_cap: int = 0
    custom_ceiling: int = 0
    device_name: str = ""
    device_total: int = 0             # 0: no discrete device
    device_free: int | None = None
    device_own: int = 0
    custom_device_ceiling: int = 0


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
                  gpu_cap=given["gpu_cap"] or 0, custom_ceiling=given["custom_ceiling"] or 0,
                  device_total=given["device_total"] or 0, device_free=given["device_free"],
                  device_own=given["device_own"] or 0,
                  custom_device_ceiling=given["custom_device_ceiling"] or 0)


def read_machine() -> WhatIf:
    """This machine through shared.probe (imported only on this path); NVML's
    device 0 when there is one (SPEC D1), else no device pool."""
    from shared import probe
    from supervisor.cli.probe import read_device_quietly

    host = probe.read_host_counters()
    device, _why = read_device_quietly()  # no device: the host table alone, no warning
    if device is None:
        return WhatIf(host=host, own=probe.own_footprint() or 0)
    return WhatIf(host=host, own=probe.own_footprint() or 0, device_name=device.name,
                  device_total=device.total, device_free=device.free)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


_COLUMNS = (
    ("tier", None), ("reserve", "reserve_bytes"), ("free", "free_bytes"),
    ("inactive", "inactive_bytes"), ("other apps", "other_apps_bytes"),
    ("static", "static_bytes"), ("dynamic", "dynamic_bytes"), ("gpu cap", "gpu_cap_bytes"),
    ("ceiling", "ceiling_bytes"), ("soft", "soft_bytes"), ("hard", "hard_bytes"),
    ("binding", "binding"),
)


_DEVICE_COLUMNS = (
    ("tier", None), ("reserve", "reserve_bytes"), ("free", "free_bytes"),
    ("other processes", "others_bytes"), ("static", "static_bytes"), ("dynamic", "dynamic_bytes"),
    ("ceiling", "ceiling_bytes"), ("soft", "soft_bytes"), ("hard", "hard_bytes"), ("binding", "binding"),
)


def _aligned(previews: dict[str, TierPreview] | dict[str, DeviceTierPreview],
             columns: tuple[tuple[str, str | None], ...]) -> list[str]:
    rows = [[name for name, _ in columns]]
    for tier, p in previews.items():
        row = [tier]
        for _, field in columns[1:]:
            value = getattr(p, str(field))
            row.append(value if isinstance(value, str) else _gib(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i in (0, len(row) - 1) else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def render_table(previews: dict[str, TierPreview], inputs: WhatIf,
                 device: dict[str, DeviceTierPreview] | None = None) -> str:
    """A plain aligned table for people, sizes in GiB (and the device's, D6)."""
    lines = _aligned(previews, _COLUMNS)
    h = inputs.host
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
    if device:
        lines += ["", *render_device_table(device, inputs)]
    return "\n".join(lines)


def render_device_table(device: dict[str, DeviceTierPreview], inputs: WhatIf) -> list[str]:
    """D6: every tier's device ceiling (SPEC D2-D3), the host table's shape."""
    name = f" {inputs.device_name}" if inputs.device_name else ""
    free = "unknown" if inputs.device_free is None else f"{_gib(inputs.device_free)} GiB"
    lines = [f"device pool{name} (separate from host memory):", *_aligned(device, _DEVICE_COLUMNS), ""]
    lines.append(f"sizes in GiB; device {_gib(inputs.device_total)} GiB, free {free}, "
                 f"group's device bytes {_gib(inputs.device_own)} GiB")
    for tier, p in device.items():
        if p.reserve_bytes >= inputs.device_total:
            lines.append(f"{tier} reserves more device memory than the device has: every model load "
                         "would be refused")
    if not inputs.custom_device_ceiling:
        lines.append("custom: no custom device ceiling set, so it keeps balanced's device reserve")
    return lines


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
    device = device_tier_preview(inputs.device_total, inputs.device_free, inputs.device_own,
                                 inputs.custom_device_ceiling)
    if args.json:
        out: dict[str, object] = {"tiers": previews}
        if device:  # D6: only with a discrete device
            out["device"] = {"name": inputs.device_name, "total": inputs.device_total,
                             "free": inputs.device_free, "group_bytes": inputs.device_own, "tiers": device}
        sys.stdout.buffer.write(msgspec.json.encode(out) + b"\n")
    else:
        print(render_table(previews, inputs, device))
    return 0
