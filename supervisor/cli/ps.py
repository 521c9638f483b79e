"""`ps`: the models a running supervisor knows, with their memory (Ollama's `ps`, and more).

Per model: state, pinned, the A2 estimate next to the measured usage, MLX
active and pool bytes, prompt-cache bytes (in memory, and on disk: H5 as
proposed, shown for unloaded models too), the decode batch's buffers and the
live KV in them, speculative decoding's accepted of proposed tokens (GUESSES),
idle time, TTL and when it expires, restarts, and what its last load took (SPEC W3: every phase's seconds in `--json`'s `load_phases`;
`spare` when a spare worker took it). Spare workers (W1) are rows of their own,
`(spare)` with no model id. PREFETCHED: the bytes of a model's weights read ahead
into the page cache (W4). `--json` prints the `ModelInfo` list for scripts.
"""

from __future__ import annotations

import argparse

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from supervisor.cli._control import call
from supervisor.policy.status import ModelInfo, ServerStatus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON list of models")
    parser.add_argument("--all", action="store_true", help="also the models that are not loaded")


def run(args: argparse.Namespace) -> int:
    code, reply = call(args, p.StatusRequest(), timeout=30.0, quiet=True)
    if code != 0 or not isinstance(reply, p.ControlOk):
        return code
    status = msgspec.json.decode(reply.data, type=ServerStatus)
    models = [m for m in status.models if args.all or m.state != "unloaded"] + spares(status)
    if args.json:
        print(msgspec.json.encode(models).decode())
    else:
        print(table(models))
    return 0


def spares(status: ServerStatus) -> list[ModelInfo]:
    """W1: each spare worker as a row with no model id, state `starting` or `spare`."""
    return [ModelInfo(id="", path="", pinned=False, state=w.state, worker=w.worker, pid=w.pid, usage=w.usage,
                      mlx_active=w.mlx_active, mlx_pool=w.mlx_pool)
            for w in status.guard.workers if not w.model and w.state not in ("stopped", "dead")]


def _load(m: ModelInfo) -> str:
    """W3: what its last load took in all, and whether a spare took it."""
    if not m.load_phases:
        return "-"
    return f"{sum(m.load_phases.values()):.2f}s" + (" spare" if m.load_spare else "")


def _size(n: int) -> str:
    return format_size(n) if n else "-"


def _seconds(s: float | None) -> str:
    if s is None:
        return "never"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m"


def _guesses(m: ModelInfo) -> str:
    """Speculative decoding: accepted of proposed tokens, and the share."""
    if not m.proposed_tokens:
        return "-"
    return f"{m.accepted_tokens}/{m.proposed_tokens} ({100 * m.accepted_tokens / m.proposed_tokens:.0f}%)"


def table(models: list[ModelInfo]) -> str:
    header = ("MODEL", "STATE", "PIN", "ESTIMATE", "USAGE", "ACTIVE", "POOL", "CACHE", "DISK", "BATCH", "LIVE KV",
              "GUESSES", "IDLE", "TTL", "EXPIRES", "RESTARTS", "LOAD", "PREFETCHED")
    rows = [header]
    for m in models:
        name = (m.id or "(spare)") + (f" ({', '.join(m.aliases)})" if m.aliases else "")
        rows.append((
            name, m.state, "yes" if m.pinned else "", _size(m.estimated_bytes), _size(m.usage),
            _size(m.mlx_active), _size(m.mlx_pool), _size(m.cache_bytes), _size(m.disk_cache_bytes),
            _size(m.batch_bytes), _size(m.batch_live_bytes), _guesses(m),
            _seconds(m.idle_seconds) if m.worker else "-", _seconds(m.ttl) if m.ttl else "-",
            _seconds(m.expires_in) if m.ttl and m.worker else "-", str(m.restarts), _load(m), _size(m.prefetched_bytes),
        ))
    if len(rows) == 1:
        return "no model is loaded (ps --all lists every known model)"
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
