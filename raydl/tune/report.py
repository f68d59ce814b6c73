"""What a sweep reports: per-trial metrics from the step records, the table, results.csv/json, a plot, best.yaml.

Pure functions of plain data (the step records every raydl run writes to metrics.jsonl), so
they are tested without Ray. Time is *training* time: the sum of step times (compute, data
waits, checkpoint saves) without evaluation passes and without the fixed cost of starting
Ray workers, which is the same for every configuration.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
import warnings
from pathlib import Path
from typing import Any

import yaml

from raydl import commands
from raydl.metrics.stopwatch import wall_clock
from raydl.telemetry.cost import format_usd

# Steps averaged for the train loss that is compared with target_loss: one step's loss is noisy.
LOSS_WINDOW = 10
COLUMNS = ("trial", "batch", "precision", "lr", "samples_per_s", "peak_memory_mb", "eval_loss",
           "time_to_target_s", "train_s", "cost_usd", "cost_to_target_usd", "start_s", "first_step_after_sweep_s",
           "steps", "status", "reason")


def stitch(runs: list[list[dict[str, Any]]], upto_step: int | None = None) -> list[dict[str, Any]]:
    """Records of a trial's attempts in order -> one history: a resumed attempt replaces the steps it redoes."""
    out: list[dict[str, Any]] = []
    for records in runs:
        for r in records:
            while out and out[-1]["step"] >= r["step"]:
                out.pop()
            out.append(r)
    return [r for r in out if upto_step is None or r["step"] <= upto_step]


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_seconds(records: list[dict[str, Any]]) -> list[float]:
    """Cumulative training time after each step, reports and checkpoints included; an eval's time lands in the
    next step's between_s, so take it out."""
    total, prev_eval, out = 0.0, 0.0, []
    for r in records:
        total += max(0.0, r["step_s"] + r.get("between_s", 0.0) - prev_eval)
        prev_eval = r.get("eval_s", 0.0)
        out.append(total)
    return out


def reached_at(records: list[dict[str, Any]], final_eval: float | None, *, target: float | None,
               metric: str) -> int | None:
    """Index of the step where the loss first reaches `target` (train: mean of the last LOSS_WINDOW steps;
    eval: a periodic eval, else the final one, counted at the last step)."""
    if target is None or not records:
        return None
    for i, r in enumerate(records):
        if metric == "train_loss":
            window = [x["loss"] for x in records[max(0, i + 1 - LOSS_WINDOW):i + 1]]
            if len(window) == min(LOSS_WINDOW, len(records)) and sum(window) / len(window) <= target:
                return i
        elif r.get("eval_loss") is not None and r["eval_loss"] <= target:
            return i
    if metric == "eval_loss" and final_eval is not None and final_eval <= target:
        return len(records) - 1
    return None


def time_to_target(records: list[dict[str, Any]], final_eval: float | None, *, target: float | None,
                   metric: str) -> float | None:
    """Training seconds until the loss first reaches `target`."""
    i = reached_at(records, final_eval, target=target, metric=metric)
    return None if i is None else train_seconds(records)[i]


def trial_cost(attempts: list[list[dict[str, Any]]], final_eval: float | None, *, target: float | None,
               metric: str) -> dict[str, float | None]:
    """$ a trial spent over all its attempts, and $ until its loss reached `target` (None: unknown or not reached).

    Every metrics.jsonl line carries its run's running cost (raydl.telemetry.cost), and each attempt is a run.
    The target is found on the stitched history, as time_to_target finds it; the $ to reach it is every earlier
    attempt's whole cost (the steps they lost were paid for) plus the running cost at that step in the attempt
    whose line the history kept."""
    spent = [records[-1].get("cost_usd") if records else 0.0 for records in attempts]
    total = None if None in spent else sum(spent)
    history = stitch(attempts)
    i = reached_at(history, final_eval, target=target, metric=metric)
    if i is None or total is None:
        return {"cost_usd": total, "cost_to_target_usd": None}
    step = history[i]["step"]
    kept = max(k for k, records in enumerate(attempts) if any(r["step"] == step for r in records))
    at_step = [r for r in attempts[kept] if r["step"] == step][-1]["cost_usd"]
    return {"cost_usd": total, "cost_to_target_usd": sum(spent[:kept]) + at_step}


def trial_metrics(records: list[dict[str, Any]], final: dict[str, Any] | None, *, target: float | None,
                  target_metric: str) -> dict[str, Any]:
    """Flat scalars for Tune and the table. Before the end, eval_loss is the latest periodic eval.

    A value that is not known yet (no eval so far, target not reached, no accuracy for this task) or
    not finite is left out, not sent as nan/inf: Tune's TensorBoard logger warns on every one ("NaN or
    Inf found in input tensor"), and ASHA skips a result without its metric until the metric exists.
    """
    steady = records[len(records) // 5:] or records
    evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
    eval_info = (final or {}).get("eval", {})
    metrics = {
        "step": records[-1]["step"] if records else 0,
        "samples": sum(r["samples"] for r in records),
        "loss": statistics.fmean(r["loss"] for r in records[-LOSS_WINDOW:]) if records else None,
        "samples_per_s": wall_clock([(r["step"], r["samples"], r["time"], r["step_s"] + r.get("between_s", 0.0))
                                     for r in steady])[0],   # as a stopwatch sees it
        "peak_memory_mb": max((r["peak_memory_mb"] for r in records), default=0.0),
        "train_s": train_seconds(records)[-1] if records else 0.0,
        "eval_loss": eval_info.get("loss", evals[-1] if evals else None),
        "eval_accuracy": eval_info.get("accuracy"),
        "time_to_target_s": time_to_target(records, eval_info.get("loss"), target=target, metric=target_metric),
        "final": final is not None,
    }
    return {k: v for k, v in metrics.items() if _finite(v)}


def start_times(starts: list[dict[str, Any]], trial: str, records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Seconds to a trial's first finished step (of its latest attempt, `records`): from the trial's start
    (`start_s`) and from the start of the sweep run that started it (`first_step_after_sweep_s`).

    `starts`: the sweep's start lines ({time}) and its trials' ({trial, time}), in order; a resumed sweep adds
    its own, so the latest start before the step is the one that counts. None: no step yet."""
    first_step = records[0]["time"] if records else None
    began = _latest([s["time"] for s in starts if s.get("trial") == trial], first_step)
    sweep = _latest([s["time"] for s in starts if "trial" not in s], began)
    return {"start_s": None if began is None else first_step - began,
            "first_step_after_sweep_s": None if sweep is None else first_step - sweep}


def _latest(times: list[float], upto: float | None) -> float | None:
    return None if upto is None else max((t for t in times if t <= upto), default=None)


def median_start(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    known = [r["start_s"] for r in rows if _finite(r.get("start_s"))]
    return {"median_start_s": statistics.median(known) if known else None}


def soonest_per_precision(rows: list[dict[str, Any]]) -> str | None:
    """Which precision reached the target loss soonest, with each precision's soonest trial: what a sweep over
    precisions (fp8 against bf16, say) is read for. None when the sweep tried one precision."""
    precisions = sorted({r["precision"] for r in rows})
    if len(precisions) < 2:
        return None

    def soonest(precision: str) -> dict[str, Any] | None:
        reached = [r for r in rows if r["precision"] == precision and _finite(r.get("time_to_target_s"))]
        return min(reached, key=lambda r: r["time_to_target_s"], default=None)

    best = {p: soonest(p) for p in precisions}
    reached = sorted((r["time_to_target_s"], p) for p, r in best.items() if r)
    verdict = f"{reached[0][1]} reached the target loss soonest" if reached else "no precision reached the target loss"
    each = [f"{p} {r['time_to_target_s']:.1f} s ({r['trial']})" if r else f"{p} never" for p, r in best.items()]
    return f"{verdict}: {', '.join(each)}"


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt))\b:?\s*(.*)")


def failure_reason(error: BaseException | str | None) -> str:
    """The root cause of a failed trial in one line, e.g. 'OutOfMemoryError: ...' or 'worker died (SIGILL?)'."""
    text = str(error or "")
    if "SYSTEM_ERROR" in text or "died unexpectedly" in text or "ActorDiedError" in text:
        signal = re.search(r"(SIG[A-Z]+|exit code -?\d+|exit_code=-?\d+)", text)
        return f"worker process died ({signal.group(1) if signal else 'crash, out of host memory or a signal'})"
    causes = [m for m in (_ERROR_LINE.search(line.strip()) for line in text.splitlines()) if m]
    wrappers = {"RayTaskError", "TrainingFailedError", "WorkerGroupError", "TuneError", "RayActorError"}
    useful = [m for m in causes if m.group(1) not in wrappers and m.group(2).strip()]
    pick = useful or causes
    if not pick:
        return text.strip().splitlines()[-1][:300] if text.strip() else "unknown error"
    name, message = pick[-1].groups()
    return f"{name}: {message.strip()}"[:300]


def best_row(rows: list[dict[str, Any]], key: str, mode: str) -> dict[str, Any] | None:
    candidates = [r for r in rows if r["status"] == "ok" and _finite(r.get(key))]
    if not candidates:
        return None
    return (min if mode == "min" else max)(candidates, key=lambda r: r[key])


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def format_table(rows: list[dict[str, Any]], extra_keys: list[str], best: dict[str, Any] | None) -> str:
    """One line per trial; the cost columns only where a price applied to some trial (a local CPU sweep has none)."""
    priced = any(r.get("cost_usd") is not None for r in rows)
    head = ["trial", "batch", "precision", *[k.split(".")[-1] for k in extra_keys], "samples/s", "peak MB",
            "eval loss", "time to target s", *(["cost", "cost to target"] if priced else []), "start s", "status"]
    body = []
    for r in rows:
        mark = "*" if best is not None and r["trial"] == best["trial"] else " "
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason'].split('. Fix:')[0]}"[:90]
        cost = [format_usd(r.get("cost_usd")), format_usd(r.get("cost_to_target_usd"))] if priced else []
        body.append([mark + r["trial"], _fmt(r["batch"]), r["precision"], *[_fmt(r["params"].get(k)) for k in extra_keys],
                     _fmt(r["samples_per_s"], 4), _fmt(r["peak_memory_mb"], 4), _fmt(r["eval_loss"]),
                     _fmt(r["time_to_target_s"]), *cost, _fmt(r.get("start_s")), status])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    median = median_start(rows)["median_start_s"]
    footer = [] if median is None else [f"median trial start (trial start -> first finished step): {median:.1f} s"]
    footer += [line for line in [soonest_per_precision(rows)] if line]
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body), *footer])


def json_safe(x: Any) -> Any:
    """inf/nan -> None: results.json stays strict JSON that every tool reads."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_csv(rows: list[dict[str, Any]], path: Path, extra_keys: list[str]) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([*COLUMNS, *extra_keys])
    for r in rows:
        writer.writerow([_csv(r.get(c)) for c in COLUMNS] + [_csv(r["params"].get(k)) for k in extra_keys])
    path.write_text(buf.getvalue())


def _csv(x: Any) -> Any:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def write_best(best: dict[str, Any], config: dict[str, Any], path: Path, *, objective: str, sweep_dir: Path) -> None:
    header = (f"# Best trial {best['trial']} of the sweep in {sweep_dir} (objective {objective}).\n"
              f"# Train it: {commands.train_with(path.resolve())}\n")
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))


def plot(rows: list[dict[str, Any]], curves: dict[str, list[dict[str, Any]]], path: Path, *,
         target: float | None) -> bool:
    """Throughput and time to target per batch size (a line per precision) and the loss curves; False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed, so no results.png: pip install 'raydl[plot]'", stacklevel=2)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for precision in sorted({r["precision"] for r in rows}):
        ok = sorted((r for r in rows if r["precision"] == precision and r["status"] == "ok"), key=lambda r: r["batch"])
        axes[0].plot([r["batch"] for r in ok], [r["samples_per_s"] for r in ok], "o-", label=precision)
        reached = [r for r in ok if _finite(r["time_to_target_s"])]
        axes[1].plot([r["batch"] for r in reached], [r["time_to_target_s"] for r in reached], "o-", label=precision)
    for ax, title in ((axes[0], "throughput (samples/s)"), (axes[1], f"time to loss {target} (training s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch size")
        ax.set_title(title)
        ax.legend()
    for r in rows:
        records = curves.get(r["trial"], [])
        if records:
            axes[2].plot(train_seconds(records), [x["loss"] for x in records], lw=1,
                         label=f"bs {r['batch']} {r['precision']}" + ("" if r["status"] == "ok" else f" ({r['status']})"))
    if target is not None:
        axes[2].axhline(target, color="k", ls="--", lw=0.8)
    axes[2].set(xlabel="training seconds", ylabel="train loss", title="loss curves")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
