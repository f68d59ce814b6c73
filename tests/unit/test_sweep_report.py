"""Sweep report pieces on hand-made step records: metrics, failure reasons, table, files, plot."""

from __future__ import annotations

import csv
import json
import math

import pytest

from raydl.tune import report


def records(losses, *, step_s=0.5, batch=64, start=1, **extra):
    return [{"step": start + i, "loss": loss, "samples": batch, "step_s": step_s, "samples_per_s": batch / step_s,
             "time": 1e9 + (start + i) * step_s, "peak_memory_mb": 100.0 + i, **extra} for i, loss in enumerate(losses)]


def test_stitch_drops_the_steps_a_resumed_attempt_redoes():
    first = records([3.0, 2.9, 2.8, 2.7])                 # steps 1-4, checkpoint at step 2, killed at 4
    second = records([2.75, 2.6], start=3)                # resumed from step 2
    joined = report.stitch([first, second])
    assert [r["step"] for r in joined] == [1, 2, 3, 4] and joined[2]["loss"] == 2.75
    assert [r["step"] for r in report.stitch([first], upto_step=2)] == [1, 2]


def test_start_times_count_from_the_starts_that_led_to_the_latest_attempt():
    # sweep at 100, trial a at 107 (first step 110); interrupted, resumed at 200, a again at 205 (first step 209)
    starts = [{"time": 100.0}, {"trial": "a", "time": 107.0}, {"trial": "b", "time": 108.0},
              {"time": 200.0}, {"trial": "a", "time": 205.0}]
    first_attempt, second_attempt = records([3.0], time=110.0), records([2.9], time=209.0)
    assert report.start_times(starts, "a", first_attempt) == {"start_s": 3.0, "first_step_after_sweep_s": 10.0}
    assert report.start_times(starts, "a", second_attempt) == {"start_s": 4.0, "first_step_after_sweep_s": 9.0}
    assert report.start_times(starts, "b", []) == {"start_s": None, "first_step_after_sweep_s": None}
    rows = [{"start_s": 3.0}, {"start_s": None}, {"start_s": 5.0}, {}]
    assert report.median_start(rows) == {"median_start_s": 4.0}
    assert report.median_start([{}]) == {"median_start_s": None}


def test_time_to_target_uses_a_window_of_train_losses_or_the_evals():
    recs = records([3.0] * 5 + [1.0] * 20, step_s=0.1)
    # the 10-step mean first reaches 1.0 at step 15: 15 steps of 0.1 s
    assert report.time_to_target(recs, None, target=1.0, metric="train_loss") == pytest.approx(1.5)
    assert report.time_to_target(recs, None, target=0.5, metric="train_loss") is None
    evals = records([2.0] * 4, step_s=1.0)
    evals[1].update(eval_loss=1.4, eval_s=3.0)             # the eval's 3 s land in step 3's step_s
    evals[2]["step_s"] = 4.0
    assert report.train_seconds(evals) == [1.0, 2.0, 3.0, 4.0]
    assert report.time_to_target(evals, None, target=1.5, metric="eval_loss") == 2.0
    assert report.time_to_target(evals, 1.1, target=1.2, metric="eval_loss") == 4.0   # reached by the final eval


def test_trial_metrics_before_and_after_the_final_report():
    recs = records([2.0] * 10, step_s=0.25, batch=32)
    live = report.trial_metrics(recs, None, target=1.0, target_metric="train_loss")
    # Not known yet: left out rather than nan/inf (Tune's TensorBoard logger warns on each of those).
    assert live["final"] is False and not {"eval_loss", "eval_accuracy", "time_to_target_s"} & set(live)
    assert live["samples"] == 320 and live["samples_per_s"] == 128 and live["peak_memory_mb"] == 109
    done = report.trial_metrics(recs, {"eval": {"loss": 1.9, "accuracy": 0.4}}, target=2.0, target_metric="train_loss")
    assert done["final"] and done["eval_loss"] == 1.9 and done["time_to_target_s"] == pytest.approx(2.5)


def test_trial_metrics_never_hold_a_non_finite_number():
    diverged = records([2.0, math.nan, math.inf], eval_loss=math.nan)
    for recs, final in (([], None), (diverged, None), (diverged, {"eval": {"loss": math.nan, "accuracy": math.inf}})):
        metrics = report.trial_metrics(recs, final, target=1.0, target_metric="eval_loss")
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert "loss" not in metrics and "eval_loss" not in metrics and "samples" in metrics


TRAIN_ERROR = """ray.exceptions.RayTaskError(WorkerGroupError): ray::ImplicitFunc.train() (pid=1, repr=run_trial)
ray.train.WorkerGroupError: Training failed due to worker errors:
[Rank 0 Error Snippet]:
  File "/work/main/raydl/train/loop.py", line 150, in report
FloatingPointError: training diverged: loss is nan at step 6 (lr 1e+03). Fix: lower train.lr"""


@pytest.mark.parametrize("text, expected", [
    (TRAIN_ERROR, "FloatingPointError: training diverged: loss is nan at step 6 (lr 1e+03). Fix: lower train.lr"),
    ("WorkerGroupError: Training failed\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("ActorDiedError: The actor died unexpectedly ... SYSTEM_ERROR ... killed by SIGILL", "worker process died (SIGILL)"),
    (None, "unknown error"),
])
def test_failure_reason_finds_the_root_cause(text, expected):
    assert report.failure_reason(text) == expected


def rows():
    base = {"params": {"train.global_batch_size": 64, "train.lr": 0.003}, "lr": 0.003, "steps": 10, "train_s": 3.0,
            "eval_accuracy": 0.5, "samples": 640, "reason": ""}
    return [
        {**base, "trial": "t0", "batch": 32, "precision": "fp32", "samples_per_s": 900.0, "peak_memory_mb": 500.0,
         "eval_loss": 1.5, "time_to_target_s": 2.0, "status": "ok"},
        {**base, "trial": "t1", "batch": 64, "precision": "bf16", "samples_per_s": 1200.0, "peak_memory_mb": 480.0,
         "eval_loss": 1.6, "time_to_target_s": math.inf, "status": "ok"},
        {**base, "trial": "t2", "batch": 64, "precision": "fp32", "samples_per_s": None, "peak_memory_mb": None,
         "eval_loss": None, "time_to_target_s": None, "status": "infeasible",
         "reason": "FloatingPointError: training diverged: loss is nan at step 6. Fix: lower train.lr"},
    ]


def test_best_row_table_and_files(tmp_path):
    rs = rows()
    assert report.best_row(rs, "time_to_target_s", "min")["trial"] == "t0"   # inf never wins
    assert report.best_row(rs, "samples_per_s", "max")["trial"] == "t1"       # infeasible t2 never wins
    assert report.best_row(rs[2:], "eval_loss", "min") is None
    table = report.format_table(rs, ["train.lr"], rs[0])
    lines = table.splitlines()
    assert lines[0].split() == ["trial", "batch", "precision", "lr", "samples/s", "peak", "MB", "eval", "loss",
                                "time", "to", "target", "s", "start", "s", "status"]   # no cost: no price applied
    assert lines[2].startswith("*t0") and "infeasible: FloatingPointError: training diverged" in lines[4]
    assert "Fix:" not in table and " - " in lines[3]       # unreached target shows as '-'
    report.write_csv(rs, tmp_path / "r.csv", ["train.lr"])
    got = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert got[1]["time_to_target_s"] == "" and got[2]["status"] == "infeasible" and got[0]["train.lr"] == "0.003"
    text = json.dumps(report.json_safe({"rows": rs}))
    assert "Infinity" not in text and json.loads(text)["rows"][1]["time_to_target_s"] is None


def test_plot_writes_a_png(tmp_path):
    curves = {"t0": records([2.5, 2.0, 1.6]), "t1": records([2.5, 2.2, 1.9])}
    assert report.plot(rows(), curves, tmp_path / "p.png", target=1.8)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_the_table_names_the_precision_that_reached_the_target_soonest():
    row = lambda trial, precision, t: {"trial": trial, "precision": precision, "time_to_target_s": t}
    rows = [row("t0", "bf16", 48.0), row("t1", "bf16", 61.5), row("t2", "fp8", 41.2), row("t3", "fp8", math.inf),
            row("t4", "fp32", None)]
    assert report.soonest_per_precision(rows) == ("fp8 reached the target loss soonest: bf16 48.0 s (t0), "
                                                   "fp32 never, fp8 41.2 s (t2)")
    assert report.soonest_per_precision([row("t0", "bf16", 3.0), row("t1", "bf16", 2.0)]) is None
    assert report.soonest_per_precision([row("t0", "bf16", None), row("t1", "fp8", None)]).startswith(
        "no precision reached the target loss")
