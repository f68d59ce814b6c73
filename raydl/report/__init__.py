"""`raydl report RUN_OR_SWEEP`: a run's (or a sweep's trials') summary as a table, and report.png.

    source.py  reads the run directory or the sweep's trials (bad input: RaydlError naming the path)
    table.py   summary.json's figures: field | value for a run, a line per trial for a sweep
    figure.py  loss, throughput, data wait, memory, cost and workers against steps, resizes and restarts marked
"""

from __future__ import annotations

from pathlib import Path

from raydl.report.figure import plot
from raydl.report.source import Source, load
from raydl.report.table import format_table

PNG = "report.png"


def summary_table(source: Source) -> str:
    return format_table(source.runs, per_run_lines=source.is_sweep)


def write_png(source: Source, out: str | Path | None = None) -> Path:
    """report.png in the run or sweep directory, or at `out`."""
    path = Path(out) if out else source.path / PNG
    what = f"sweep, {len(source.runs)} trials" if source.is_sweep else "run"
    plot(source.runs, path, title=f"raydl report: {source.path.resolve().name} ({what})")
    return path


__all__ = ["load", "summary_table", "write_png", "PNG"]
