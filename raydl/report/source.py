"""What `raydl report` reads: a run directory, or a sweep directory's trials, as curves and summaries.

Everything read here is untrusted data (JSON only; nothing in it runs or names files to open). A sweep
directory is raydl/tune/sweep.py's layout (its names are repeated here so that a report does not
import Ray): sweep.yaml, trials/<trial>/attempt-N/ run directories, results.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydl.errors import RaydlError
from raydl.tune.report import stitch

METRICS, SUMMARY, RUN_CONFIG = "metrics.jsonl", "summary.json", "config.yaml"
SWEEP_FILE, TRIALS_DIR, SWEEP_RESULTS = "sweep.yaml", "trials", "results.json"
READS = (METRICS, SUMMARY, RUN_CONFIG, SWEEP_FILE, SWEEP_RESULTS)   # every file a report opens, by name
ATTEMPT = re.compile(r"attempt-(\d+)")
TOTALS = ("device_hours", "cost_usd")   # running totals on every metrics.jsonl line (raydl.telemetry.cost)
LABEL_CHARS = 80   # a trial's label in the table and the legend
SOURCE_FORM = "a run directory (runs/<run>, holding metrics.jsonl) or a sweep directory (runs/<sweep>, holding sweep.yaml)"


@dataclass
class Marker:
    """Where a new worker group took over: a resize (other world size) or a restart (failure, preemption, resume)."""
    step: int
    kind: str      # "resize" or "restart"
    text: str


@dataclass
class RunCurves:
    """One run (or sweep trial): its steps with redone ones replaced, its summary when it finished, its markers."""
    label: str
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None
    markers: list[Marker] = field(default_factory=list)
    note: str = "-"   # what the table should say about where its figures come from


@dataclass
class Source:
    path: Path
    is_sweep: bool
    runs: list[RunCurves]   # the run, or the sweep's trials in trial order


def load(path: str | Path) -> Source:
    source = Path(path)
    if not source.is_dir():
        raise RaydlError(f"report source '{source}' is not a directory. Fix: pass {SOURCE_FORM}.")
    if (source / SWEEP_FILE).is_file():
        return Source(source, True, _sweep(source))
    if not (source / METRICS).is_file() and not (source / RUN_CONFIG).is_file():
        raise RaydlError(f"report source '{source}' is neither a run nor a sweep directory (no {METRICS}, "
                         f"{RUN_CONFIG} or {SWEEP_FILE}). Fix: pass {SOURCE_FORM}.")
    return Source(source, False, [_run(source, source.name)])


def _run(run_dir: Path, label: str) -> RunCurves:
    records = read_metrics(run_dir)
    summary = read_summary(run_dir)
    curves = RunCurves(label, stitch([records]), summary, restart_markers(summary))
    resumed_from = (summary or {}).get("resumed_from")
    if isinstance(resumed_from, str):   # a resumed run's own directory holds its steps from there on
        curves.note = f"resumed from {resumed_from}"
    return curves


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's step records; a missing or empty file, or a line that is not a step record, is bad input."""
    path = run_dir / METRICS
    if not path.is_file():
        raise RaydlError(f"run directory '{run_dir}' has no {METRICS}: the run stopped before its first report. "
                         f"Fix: report a run that trained at least telemetry.report_every steps.")
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if line.strip():
            records.append(_step_record(line, path, number))
    if not records:
        raise RaydlError(f"'{path}' is empty: the run wrote no step. Fix: report a run that trained at least "
                         f"telemetry.report_every steps.")
    return records


def _step_record(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise RaydlError(f"'{path}' line {number} is not JSON ({e}). Fix: pass a metrics.jsonl that raydl wrote "
                         f"(a cut-off last line means the writer was killed: delete that line).") from None
    if not (isinstance(record, dict) and isinstance(record.get("step"), int) and _number(record.get("loss"))):
        raise RaydlError(f"'{path}' line {number} is not a step record (needs an integer 'step' and a number "
                         f"'loss'). Fix: pass a metrics.jsonl that raydl wrote.")
    return record


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """summary.json, or None when the run did not finish (killed, stopped early by ASHA, still running)."""
    path = run_dir / SUMMARY
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(errors="replace"))
    except ValueError as e:
        raise RaydlError(f"'{path}' is not JSON ({e}). Fix: delete it to report the run from {METRICS} alone.") from None
    if not isinstance(summary, dict):
        raise RaydlError(f"'{path}' is not a JSON object. Fix: delete it to report the run from {METRICS} alone.")
    return summary


def restart_markers(summary: dict[str, Any] | None) -> list[Marker]:
    """summary.json's restarts: each marks the first step its new worker group ran."""
    restarts = (summary or {}).get("restarts")
    markers = []
    for r in restarts if isinstance(restarts, list) else []:
        if isinstance(r, dict) and isinstance(r.get("resumed_at_step"), int):
            cause = str(r.get("cause", "restart"))
            markers.append(Marker(r["resumed_at_step"] + 1, "resize" if cause.startswith("resize") else "restart", cause))
    return markers


def _sweep(sweep_dir: Path) -> list[RunCurves]:
    trials_dir = sweep_dir / TRIALS_DIR
    trials = sorted(p for p in trials_dir.iterdir() if p.is_dir()) if trials_dir.is_dir() else []
    labels = _trial_labels(sweep_dir)
    runs = [_trial(t, labels.get(t.name, t.name)) for t in trials]
    if not any(r.records for r in runs):
        raise RaydlError(f"sweep directory '{sweep_dir}' has no trial with a {METRICS} under {TRIALS_DIR}/. Fix: "
                         f"report it once a trial has trained telemetry.report_every steps.")
    return runs


def _trial(trial_dir: Path, label: str) -> RunCurves:
    """A trial's attempts as one run: a resumed attempt replaces the steps it redoes, and is marked."""
    attempts = sorted((p for p in trial_dir.iterdir() if ATTEMPT.fullmatch(p.name) and (p / METRICS).is_file()),
                      key=lambda p: int(ATTEMPT.fullmatch(p.name).group(1)))
    runs = [_run(a, label) for a in attempts]
    markers = []
    for n, (attempt, run) in enumerate(zip(attempts, runs)):
        if n:
            markers.append(Marker(run.records[0]["step"], "restart", f"resumed ({attempt.name})"))
        markers.extend(run.markers)
    if len(runs) < 2:
        return RunCurves(label, runs[0].records if runs else [], runs[0].summary if runs else None, markers)
    history = stitch(_totals_over_attempts([r.records for r in runs]))
    summary = runs[-1].summary and {**runs[-1].summary, **{k: history[-1][k] for k in TOTALS if k in history[-1]}}
    return RunCurves(label, history, summary, markers, f"figures of {attempts[-1].name}; cost over all attempts")


def _totals_over_attempts(attempts: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Each attempt is a run whose running totals start at 0: carry the earlier attempts' on, so that a trial's
    curve and last line are what the whole trial spent (as the sweep's cost column counts it)."""
    carried = []
    for key in TOTALS:
        spent = [records[-1].get(key) for records in attempts]
        if all(_number(x) for x in spent):
            carried.append((key, [sum(spent[:n]) for n in range(len(spent))]))
    return [[{**r, **{key: r[key] + before[n] for key, before in carried if _number(r.get(key))}} for r in records]
            for n, records in enumerate(attempts)]


def _trial_labels(sweep_dir: Path) -> dict[str, str]:
    """Trial id -> 'id: key=value, ...' from results.json (absent until the sweep ends)."""
    try:
        rows = json.loads((sweep_dir / SWEEP_RESULTS).read_text()).get("trials", [])
    except (OSError, ValueError, AttributeError):
        return {}
    labels = {}
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and isinstance(row.get("trial"), str) and isinstance(row.get("params"), dict):
            params = ", ".join(f"{str(k).split('.')[-1]}={v}" for k, v in row["params"].items())
            labels[row["trial"]] = f"{row['trial']}: {params}"[:LABEL_CHARS]
    return labels


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
