"""A timeline as a picture: what the guard saw and what it did, on one axis.

Time on x. The ceiling, soft and hard watermarks are lines; each worker's
usage is stacked (the supervisor's own footprint is the bottom layer) and
the group usage is the outline; the pressure level is a band along the top;
every decision and event is a labelled marker. matplotlib with the Agg
backend: no display needed (CI, ssh).

Public names (stable): draw.
"""

from __future__ import annotations

from pathlib import Path

from shared.sizes import MiB
from supervisor.lab.timeline import MarkKind, Timeline

_LEVEL_COLOURS = {"ok": "#c7e9c0", "soft": "#fdd0a2", "hard": "#fc9272"}
_DECISION_STYLE: dict[MarkKind, tuple[str, str]] = {
    "stop": ("v", "#d62728"), "expire_ttl": ("v", "#8c564b"), "abort_requests": ("x", "#d62728"),
    "abort_load": ("x", "#9467bd"), "mark_for_unload": ("D", "#e377c2"), "reclaim": ("o", "#1f77b4"),
    "shrink_hot_cache": ("o", "#17becf"),
}
_EVENT_KINDS_SHOWN: frozenset[MarkKind] = frozenset({
    "spawn", "loaded", "exit", "crash", "respawn", "refused", "evict", "ttl", "failed", "drill", "ceiling", "request",
    "load_failed", "wedged", "thrash", "prefetch"})


def draw(timeline: Timeline, path: Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6.5), dpi=100)
    pts = timeline.points
    if pts:
        _stack(ax, timeline)
        ts = [pt.t for pt in pts]
        ax.step(ts, [pt.usage / MiB for pt in pts], where="post", color="black", lw=1.2, label="group usage (U2)")
        ax.step(ts, [pt.ceiling / MiB for pt in pts], where="post", color="#d62728", lw=1.5, label="ceiling")
        ax.step(ts, [pt.hard / MiB for pt in pts], where="post", color="#ff7f0e", lw=1, ls="--", label="hard")
        ax.step(ts, [pt.soft / MiB for pt in pts], where="post", color="#bcbd22", lw=1, ls="--", label="soft")
        _levels(ax, timeline)
    _marks(ax, timeline)
    if pts:
        ax.set_xlim(_start(timeline), max(pts[-1].t, _start(timeline) + 0.5))
    cropped = _start(timeline) > 0
    ax.set_xlabel("seconds since the start" + (" (model loads before the scenario's ceiling cropped)" if cropped
                                                else ""))
    ax.set_ylabel("MiB")
    ax.set_title(title or timeline.name)
    ax.legend(loc="lower left", fontsize=7, ncol=4, framealpha=0.8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _stack(ax, timeline: Timeline) -> None:
    pts = timeline.points
    labels: list[str] = []
    for pt in pts:
        for name in pt.workers:
            if name not in labels:
                labels.append(name)
    ts = [pt.t for pt in pts]
    base = [(pt.usage - sum(pt.workers.values())) / MiB for pt in pts]
    layers = [base] + [[pt.workers.get(name, 0) / MiB for pt in pts] for name in labels]
    ax.stackplot(ts, *layers, labels=["supervisor"] + labels, alpha=0.55, step="post")


def _levels(ax, timeline: Timeline) -> None:
    """The level as a coloured band along the top of the plot."""
    pts = timeline.points
    top = _top(timeline) / MiB
    ax.set_ylim(0, top)
    first = _start(timeline)
    start, level = pts[0].t, pts[0].level
    for pt in pts[1:] + [None]:
        if pt is None or pt.level != level:
            end = pt.t if pt is not None else pts[-1].t
            ax.axvspan(start, end, ymin=0.965, ymax=1.0, color=_LEVEL_COLOURS.get(level, "#dddddd"), lw=0)
            if end >= first:
                ax.text(max(start, first), top * 0.985, level, fontsize=7, va="top", clip_on=True)
            if pt is not None:
                start, level = pt.t, pt.level


def _top(timeline: Timeline) -> float:
    """Room for the usage and the ceilings near it; a machine-sized ceiling
    (before a scenario sets its own) would flatten everything else."""
    peak = max(pt.usage for pt in timeline.points)
    near = [pt.ceiling for pt in timeline.points if 0 < pt.ceiling <= 3 * peak]
    return max(peak * 1.15, max(near, default=0) * 1.12, 1.0)


def _start(timeline: Timeline) -> float:
    """From a second before the scenario set its ceiling (model loads before that are setup)."""
    ceilings = [m.t for m in timeline.marks if m.kind == "ceiling"]
    return max(0.0, min(ceilings) - 1.0) if ceilings else 0.0


def _marks(ax, timeline: Timeline) -> None:
    """Decisions on the plot at the usage they were taken at; events as thin verticals."""
    pts = timeline.points
    ymax = ax.get_ylim()[1]

    def usage_at(t: float) -> float:
        best = None
        for pt in pts:
            if pt.t > t:
                break
            best = pt
        return (best.usage if best else 0) / MiB

    row = 0
    start = _start(timeline)
    end = pts[-1].t if pts else float("inf")
    for m in timeline.marks:
        if m.t < start or m.t > end:
            continue  # setup before the scenario's ceiling; shutdown after the record
        if m.decision:
            shape, colour = _DECISION_STYLE.get(m.kind, ("s", "#333333"))
            y = usage_at(m.t)
            ax.plot([m.t], [y], marker=shape, color=colour, ms=9, mew=2, ls="none")
            ax.annotate(f"{m.kind} {m.label}", (m.t, y), xytext=(4, 6 + 9 * (row % 3)),
                        textcoords="offset points", fontsize=7, color=colour)
            row += 1
        elif m.kind in _EVENT_KINDS_SHOWN:
            ax.axvline(m.t, color="#7f7f7f", lw=0.6, ls=":")
            ax.text(m.t, ymax * (0.90 - 0.05 * (row % 6)), f" {m.kind} {m.label}", fontsize=6.5,
                    color="#404040", rotation=0, clip_on=True)
            row += 1
