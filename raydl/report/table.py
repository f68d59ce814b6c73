"""The summary table of `raydl report`: summary.json's figures as a field | value table for a run, one line
per trial for a sweep. A column that no run has a value for (MFU on CPU, cost before it was recorded) is left out.
"""

from __future__ import annotations

import math
from typing import Any

from raydl.report.source import RunCurves
from raydl.telemetry.cost import format_usd

# (header with its unit, summary.json key (dotted: nested), scale to the unit, also in a sweep's one-line rows)
COLUMNS = (
    ("steps", "steps", 1, True), ("samples", "samples", 1, False), ("first loss", "first_loss", 1, False),
    ("final loss", "final_loss", 1, True), ("eval loss", "eval.loss", 1, True),
    ("eval accuracy", "eval.accuracy", 1, False), ("samples/s", "samples_per_s", 1, True),
    ("tokens/s", "tokens_per_s", 1, False), ("data wait %", "data_wait_frac", 100, True),
    ("model TFLOP/s", "model_tflops_per_s", 1, False), ("MFU %", "mfu", 100, True),
    ("peak memory MB", "peak_memory_mb", 1, True), ("workers", "world_sizes", 1, True),
    ("restarts", "restarts", 1, True), ("precision", "precision", 1, False), ("wall s", "wall_s", 1, True),
    ("device-hours", "device_hours", 1, True), ("cost", "cost_usd", 1, True),
    ("priced as", "pricing.priced_as", 1, False),
)
MONEY = {"cost_usd"}   # shown as dollars by format_usd
NO_VALUE = "-"
CELL_CHARS = 120


def figures(run: RunCurves) -> dict[str, str]:
    """The cells of one run by header; a run without summary.json has what its records tell and a note."""
    known = dict(run.summary or {})
    if run.records and run.summary is None:   # the summary's own definitions of these three
        known.update(steps=run.records[-1]["step"], first_loss=run.records[0]["loss"], final_loss=run.records[-1]["loss"])
    cells = {header: money_or_cell(lookup(known, key), key, scale) for header, key, scale, _ in COLUMNS}
    cells["note"] = "no steps" if not run.records else "unfinished: no summary.json" if run.summary is None else run.note
    return cells


def lookup(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def money_or_cell(value: Any, key: str, scale: float) -> str:
    return format_usd(value) if key in MONEY and isinstance(value, (int, float)) else cell(value, scale)


def cell(value: Any, scale: float) -> str:
    if isinstance(value, list):   # the world sizes it ran at, or the restarts (counted)
        return str(len(value)) if all(isinstance(v, dict) for v in value) else ", ".join(map(str, value))
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, int) and scale == 1:
        return str(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        scaled = value * scale
        return f"{scaled:.0f}" if abs(scaled) >= 1000 else f"{scaled:.4g}"
    return NO_VALUE


def format_table(runs: list[RunCurves], *, per_run_lines: bool) -> str:
    """`per_run_lines`: a line per run (a sweep); else a field | value table of the one run."""
    cells = [figures(r) for r in runs]
    shown = [c[0] for c in COLUMNS if c[3] or not per_run_lines]
    headers = [h for h in [*shown, "note"] if any(c[h] != NO_VALUE for c in cells)]
    if per_run_lines:
        rows = [["trial", *headers], *([r.label, *(c[h] for h in headers)] for r, c in zip(runs, cells))]
    else:
        rows = [["field", "value"], *([h, cells[0][h]] for h in headers)]
    return aligned(rows)


def aligned(rows: list[list[str]]) -> str:
    rows = [[printable(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def printable(text: str) -> str:
    """A cell from untrusted files, on one line and without terminal control characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:CELL_CHARS])
