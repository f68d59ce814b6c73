"""The arithmetic of `raydl bench pipeline`: which (schedule, m) pairs torch accepts, the ranks' timings
reduced to one row per config beside the textbook formula and the planner's predictions, the benchmark's
goals, and the printed report (tests/unit/test_bench_pipeline.py)."""

from __future__ import annotations

import statistics
import sys
from typing import Any, Iterable

from raydl.bench import harness
from raydl.bench.pipeline_model import NUM_BLOCKS, PP
from raydl.errors import LayoutError
from raydl.parallel import schedules
from raydl.parallel.constraints import validate_layout
from raydl.parallel.cost_model import Candidate, evaluate
from raydl.parallel.profile import BlockProfile, ModelProfile

FORMULA_TOLERANCE = 0.05   # goal: measured bubble within 5 percentage points of (p-1)/(m+p-1)
MEASURABLE = 0.02          # goal: a zero-bubble schedule's bubble at least 2 points below 1f1b's


def accepted_configs(names: Iterable[str], microbatches: Iterable[int], *, batch: int,
                     pp: int = PP) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """(schedule, m) pairs torch accepts for this pp, by the planner's copy of torch's checks; and why
    each other pair was skipped."""
    accepted, skipped = [], {}
    for name in names:
        for m in microbatches:
            try:
                validate_layout(num_blocks=NUM_BLOCKS, world_size=pp, pp=pp, schedule=name,
                                num_microbatches=m, global_batch=batch, micro_batch=batch // m)
                accepted.append((name, m))
            except LayoutError as error:
                skipped[f"{name} m={m}"] = str(error)
    return accepted, skipped


def formula_bubble(name: str, m: int, pp: int = PP) -> float | None:
    """(p-1)/(m+p-1), the GPipe/1F1B bubble; None for the schedules it does not describe."""
    one_slot = schedules.get(name).bubble_slots_per_microbatch == 1
    return schedules.bubble_fraction(name, pp, m) if one_slot else None


def per_step(step_by_rank: list[list[float]], busy_by_rank: list[list[float]]) -> dict[str, list[float]]:
    """Per timed step: step = slowest rank's elapsed time, busy = busiest rank's compute, bubble."""
    steps = [max(values) for values in zip(*step_by_rank)]
    busy = [max(values) for values in zip(*busy_by_rank)]
    return {"step_s": steps, "busy_s": busy, "bubble": [1 - b / s for b, s in zip(busy, steps)]}


def sim_profile(*, cost_s: float, block_activation_bytes: int, micro_batch: int, dim: int,
                p2p_latency_s: float) -> ModelProfile:
    """The planner's view of the benchmark model: F = cost, backward = B + W = 2 cost per block.
    Parameters are given 0 bytes, so the predicted memory is the activation memory alone."""
    block = BlockProfile("b", fwd_s=cost_s, bwd_s=2 * cost_s, param_bytes=0,
                         activation_bytes=block_activation_bytes, output_bytes=micro_batch * dim * 4)
    return ModelProfile(blocks=(block,) * NUM_BLOCKS, micro_batch=micro_batch, p2p_latency_s=p2p_latency_s)


def summarize(raw: dict[str, Any], settings: dict) -> list[dict[str, Any]]:
    """One row per config: medians of the timed steps (their statistics beside), memory per rank, the
    formula and the planner."""
    rows = []
    for by_rank in zip(*raw["by_rank"]):
        schedule, m = by_rank[0]["schedule"], by_rank[0]["m"]
        stats = {key: harness.summary(values) for key, values in
                 per_step([r["step_s"] for r in by_rank], [r["busy_s"] for r in by_rank]).items()}
        row = {"schedule": schedule, "m": m, **{key: s["median"] for key, s in stats.items()}, "stats": stats,
               "pass_counts_by_rank": [r["pass_counts"] for r in by_rank],
               "peak_saved_bytes": [r["peak_saved_bytes"] for r in by_rank],
               "microbatch_saved_bytes": [r["microbatch_saved_bytes"] for r in by_rank],
               "in_flight_microbatches": [r["peak_saved_bytes"] / r["microbatch_saved_bytes"] for r in by_rank],
               "formula_bubble": formula_bubble(schedule, m)}
        row.update(_planner_columns(row, by_rank, settings, raw["p2p_latency_s"]))
        rows.append(row)
    return rows


def _planner_columns(row: dict, by_rank: tuple[dict, ...], settings: dict, latency: float) -> dict[str, Any]:
    """The planner's bubble, activation memory per rank and step time for this config. Step time twice:
    from the nominal pass cost (sim: --cost-ms) and from the measured one (busier rank's compute per
    pass, which in sim mode includes the sleeps' oversleep); real mode has only the measured one."""
    measured = _measured_pass_s(by_rank, row["m"])
    nominal = _evaluate(row, by_rank, settings, latency, settings["cost_s"] or measured)
    fitted = _evaluate(row, by_rank, settings, latency, measured)
    per_rank = [sum(nominal.stages[i].peak_memory_bytes for i in schedules.stage_indices(row["schedule"], PP, r))
                for r in range(PP)]
    return {"planner_bubble": nominal.bubble_fraction, "planner_activation_bytes": per_rank,
            "pass_s_nominal": settings["cost_s"] or measured, "pass_s_measured": measured,
            "planner_step_s": nominal.predicted_step_s,
            "step_error_pct": 100 * (nominal.predicted_step_s / row["step_s"] - 1),
            "planner_step_measured_pass_s": fitted.predicted_step_s,
            "step_error_measured_pass_pct": 100 * (fitted.predicted_step_s / row["step_s"] - 1)}


def _evaluate(row: dict, by_rank: tuple[dict, ...], settings: dict, latency: float, pass_s: float) -> Candidate:
    profile = sim_profile(cost_s=pass_s, block_activation_bytes=by_rank[0]["block_saved_bytes"],
                          micro_batch=settings["batch"] // row["m"], dim=settings["dim"], p2p_latency_s=latency)
    return evaluate(profile, world_size=PP, pp=PP, schedule=row["schedule"], global_batch=settings["batch"],
                    device_memory_bytes=2**40, num_microbatches=row["m"])


def _measured_pass_s(by_rank: tuple[dict, ...], m: int) -> float:
    """Seconds of one pass (F, B or W) of one block on one micro-batch: the median compute per step of
    the busier rank over its 3 passes x m micro-batches x blocks."""
    return max(statistics.median(r["busy_s"]) / (3 * m * r["blocks_on_rank"]) for r in by_rank)


def check_goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The three goals of issue 4's benchmark, each with the numbers it was decided on."""
    by_key = {(r["schedule"], r["m"]): r for r in rows}
    return {"formula_within_5_points": _formula_goal(rows), "zero_bubble_below_1f1b": _zero_bubble_goal(by_key),
            "1f1b_memory_below_gpipe": _memory_goal(by_key)}


def _formula_goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    checked = [{"schedule": r["schedule"], "m": r["m"], "measured": r["bubble"], "formula": r["formula_bubble"],
                "diff_points": 100 * (r["bubble"] - r["formula_bubble"])}
               for r in rows if r["formula_bubble"] is not None]
    within = all(abs(c["diff_points"]) <= 100 * FORMULA_TOLERANCE for c in checked)
    return {"pass": bool(checked) and within, "rows": checked}


def _zero_bubble_goal(by_key: dict[tuple[str, int], dict]) -> dict[str, Any]:
    checked = []
    for (name, m), r in by_key.items():
        base = by_key.get(("1f1b", m))
        if schedules.get(name).zero_bubble and base:
            below = base["bubble"] - r["bubble"] >= MEASURABLE and r["step_s"] < base["step_s"]
            checked.append({"schedule": name, "m": m, "bubble": r["bubble"], "bubble_1f1b": base["bubble"],
                            "step_s": r["step_s"], "step_1f1b_s": base["step_s"], "below": below})
    rule = f"median bubble >= {100 * MEASURABLE:.0f} points below 1f1b's at the same m, and a lower median step"
    return {"pass": any(c["below"] for c in checked), "rule": rule, "rows": checked}


def _memory_goal(by_key: dict[tuple[str, int], dict]) -> dict[str, Any]:
    pairs = [(by_key[("gpipe", m)], r) for (name, m), r in sorted(by_key.items())
             if name == "1f1b" and m >= 4 and ("gpipe", m) in by_key]
    checked = [{"m": r["m"], "gpipe_peak_bytes": max(g["peak_saved_bytes"]),
                "1f1b_peak_bytes": max(r["peak_saved_bytes"])} for g, r in pairs]
    below = all(c["1f1b_peak_bytes"] < c["gpipe_peak_bytes"] for c in checked)
    return {"pass": bool(checked) and below, "rule": "busiest rank's peak saved bytes, m >= 4", "rows": checked}


_COLUMNS = (  # (header, cell)
    ("schedule", lambda r: r["schedule"]),
    ("m", lambda r: str(r["m"])),
    ("step ms", lambda r: f"{1e3 * r['step_s']:.0f}"),
    ("busiest-rank compute ms", lambda r: f"{1e3 * r['busy_s']:.0f}"),
    ("bubble measured", lambda r: f"{r['bubble']:.3f}"),
    ("(p−1)/(m+p−1)", lambda r: "—" if r["formula_bubble"] is None else f"{r['formula_bubble']:.3f}"),
    ("planner bubble", lambda r: f"{r['planner_bubble']:.3f}"),
    ("planner step ms", lambda r: f"{1e3 * r['planner_step_s']:.0f}"),
    ("step error %", lambda r: f"{r['step_error_pct']:+.1f}"),
    ("error %, measured pass", lambda r: f"{r['step_error_measured_pass_pct']:+.1f}"),
    ("peak saved KiB r0 / r1", lambda r: _pair(r["peak_saved_bytes"], 1 / 1024)),
    ("in flight (micro-batches) r0 / r1", lambda r: _pair(r["in_flight_microbatches"], 1)),
    ("planner KiB r0 / r1", lambda r: _pair(r["planner_activation_bytes"], 1 / 1024)),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(head for head, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(cell(r) for _, cell in _COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _pair(values: list[float], scale: float) -> str:
    return " / ".join(f"{v * scale:.1f}" for v in values)


def error_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    summary = {}
    for key in ("step_error_pct", "step_error_measured_pass_pct"):
        errors = [abs(r[key]) for r in rows]
        summary[key] = {"median_abs": statistics.median(errors), "max_abs": max(errors)}
    return summary


def report(rows: list[dict[str, Any]], goals: dict[str, Any], latency: float) -> None:
    print(markdown_table(rows))
    errors = error_summary(rows)
    print(f"\nP2P latency {1e6 * latency:.0f} us. Planner step-time error, median |err| (max): "
          f"nominal pass cost {errors['step_error_pct']['median_abs']:.1f}% "
          f"({errors['step_error_pct']['max_abs']:.1f}%), measured pass cost "
          f"{errors['step_error_measured_pass_pct']['median_abs']:.1f}% "
          f"({errors['step_error_measured_pass_pct']['max_abs']:.1f}%)")
    for name, goal in goals.items():
        print(f"goal {name}: {'PASS' if goal['pass'] else 'FAIL'}")
    sys.stdout.flush()
