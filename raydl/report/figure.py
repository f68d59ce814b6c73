"""report.png: loss, throughput, data wait, memory, cost and workers against steps, one colour per run,
with the steps where a resize or a restart started a new worker group marked on every panel."""

from __future__ import annotations

import math
from pathlib import Path

from raydl.errors import RaydlError
from raydl.report.source import Marker, RunCurves

# (title, y label with unit, series: (metrics.jsonl key, scale to the unit, name, line style))
PANELS = (
    ("loss", "loss", (("loss", 1, "train", "-"), ("eval_loss", 1, "eval", "o--"))),
    ("throughput", "samples / s", (("samples_per_s", 1, "samples/s", "-"),)),
    ("data wait", "% of step time", (("data_wait_frac", 100, "data wait", "-"),)),
    ("memory", "MB", (("peak_memory_mb", 1, "peak (torch)", "-"), ("gpu_mem_used_mb", 1, "GPU used (NVML)", ":"))),
    ("cost", "$ so far (list price)", (("cost_usd", 1, "$ so far", "-"),)),
    ("workers", "workers", (("world_size", 1, "workers", "-"),)),
)
# Run colours leave out the markers' orange and red (a lone run's markers take those; a sweep's, its trial's colour).
RUN_COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
MARKER_STYLE = {"resize": {"color": "tab:orange", "ls": "-."}, "restart": {"color": "tab:red", "ls": "--"}}
MARKER_MEANING = {"resize": "resize: a new worker group of another size", "restart": "restart: a new worker group "
                  "after a failure, preemption or resume"}


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RaydlError("raydl report draws report.png with matplotlib, which is not installed. "
                         "Fix: pip install \"raydl[plot]\".") from None
    matplotlib.use("Agg")   # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[RunCurves], path: Path, *, title: str) -> None:
    plt = pyplot()
    runs = [r for r in runs if r.records]   # a trial that failed before its first step has no curve (the table says so)
    fig, axes = plt.subplots(3, 2, figsize=(15, 12))
    colors = [RUN_COLORS[i % len(RUN_COLORS)] for i in range(len(runs))]
    for ax, (name, ylabel, series) in zip(axes.flat, PANELS):
        drawn = set().union(*(_draw(ax, run, series, color) for run, color in zip(runs, colors)))
        if not drawn:
            ax.text(0.5, 0.5, f"no {name} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="gray")
        for run, color in zip(runs, colors):
            _mark(ax, run.markers, color if len(runs) > 1 else None, label_them=ax is axes.flat[0])
        ax.set(title=name, xlabel="step", ylabel=ylabel)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if name == "workers":   # from 0, so that a resize reads as the fraction of the workers it is
            ax.set_ylim(0, ax.get_ylim()[1] + 0.5)
            ax.yaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if len(series) > 1 and drawn:
            _series_legend(ax, [s for s in series if s[0] in drawn])
    handles = _legend_handles(plt, runs, colors)
    rows = -(-len(handles) // 2)
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=13)
    fig.tight_layout(rect=(0, 0.01 + 0.022 * rows, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw(ax, run: RunCurves, series, color: str) -> set[str]:
    """The run's series that it has values of, drawn; returns their keys."""
    drawn = set()
    for key, scale, _, style in series:
        points = [(r["step"], r[key] * scale) for r in run.records if _finite(r.get(key))]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, style, color=color, lw=1.2, ms=4,
                    drawstyle="steps-post" if key == "world_size" else "default")
            drawn.add(key)
    return drawn


def _mark(ax, markers: list[Marker], color: str | None, *, label_them: bool) -> None:
    """A vertical line per marker in its kind's style (in `color`, a sweep trial's, when given)."""
    for m in markers:
        style = {**MARKER_STYLE[m.kind], **({"color": color} if color else {})}
        ax.axvline(m.step, lw=1.2, **style)
        if label_them:   # the cause once, on the loss panel
            ax.annotate(m.text[:48], (m.step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=7, color=style["color"],
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


def _series_legend(ax, series) -> None:
    """Which line is which series, drawn in black: the colours are the runs'."""
    handles = [ax.plot([], [], style, color="black", label=name)[0] for _, _, name, style in series]
    ax.legend(handles=handles, fontsize=8, loc="best")


def _legend_handles(plt, runs: list[RunCurves], colors: list[str]) -> list:
    """The runs by colour (a sweep) and the marker kinds by line style."""
    handles = [plt.Line2D([], [], color=c, lw=2, label=r.label) for r, c in zip(runs, colors)] if len(runs) > 1 else []
    kinds = {m.kind for r in runs for m in r.markers}
    for kind in ("resize", "restart"):
        if kind in kinds:
            color = MARKER_STYLE[kind]["color"] if len(runs) == 1 else "black"
            handles.append(plt.Line2D([], [], lw=1.2, ls=MARKER_STYLE[kind]["ls"], color=color, label=MARKER_MEANING[kind]))
    return handles


def _finite(x) -> bool:
    """A value to draw: a diverged step's nan or inf loss would only break the axis' scale."""
    return isinstance(x, (int, float)) and math.isfinite(x)
