"""Real sweeps on the test Ray (4 logical CPUs: 2 one-worker trials at a time), end to end."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from raydl.overrides import load_config
from raydl.tune.space import parse_sweep
from raydl.tune.sweep import run_sweep

pytestmark = pytest.mark.slow


def base(data_cache, tmp_path, **train):
    return {"run": {"runs_dir": str(tmp_path / "runs")},
            "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
            "scaling": {"min_workers": 1, "max_workers": 1},
            "train": {"max_steps": 10, "warmup_steps": 2, "eval_batches": 2, **train},
            "telemetry": {"report_every": 5, "progress": False}, "checkpoint": {"every_steps": 10}}


def test_batch_by_precision_sweep_writes_report_and_a_best_yaml_that_trains(ray_session, data_cache, tmp_path, capsys,
                                                                            caplog):
    spec = parse_sweep({"base": base(data_cache, tmp_path),     # budget 10 x 64 = 640 samples per trial
                        "space": {"train.global_batch_size": [32, 64], "train.precision": ["fp32", "bf16"]},
                        "objective": "time_to_target", "target_loss": 2.6})
    summary = run_sweep(spec)
    rows = summary["trials"]
    assert [r["status"] for r in rows] == ["ok"] * 4, rows
    assert sorted((r["batch"], r["precision"], r["steps"]) for r in rows) == [
        (32, "bf16", 20), (32, "fp32", 20), (64, "bf16", 10), (64, "fp32", 10)]
    for r in rows:
        assert r["samples"] == 640 and r["samples_per_s"] > 0 and r["peak_memory_mb"] > 0
        assert 0 < r["eval_loss"] < 3.5 and 0 < r["time_to_target_s"] <= r["train_s"]
    sweep_dir = tmp_path / "runs" / next((tmp_path / "runs").iterdir()).name
    table = capsys.readouterr().out
    assert "time to target s" in table and table.count(" ok") >= 4
    assert "NaN or Inf" not in caplog.text   # Tune's TensorBoard logger saw only finite metrics
    assert len(list(csv.DictReader((sweep_dir / "results.csv").open()))) == 4
    results = json.loads((sweep_dir / "results.json").read_text())
    best = min(rows, key=lambda r: r["time_to_target_s"])
    assert results["best"] == best["trial"] and results["objective"] == "time_to_target"
    assert (sweep_dir / "results.png").read_bytes()[:4] == b"\x89PNG"

    # best.yaml is a plain training config: `raydl train --config best.yaml --set train.max_steps=5`
    best_yaml = yaml.safe_load((sweep_dir / "best.yaml").read_text())
    assert best_yaml["train"]["global_batch_size"] == best["batch"] and best_yaml["train"]["precision"] == best["precision"]
    from raydl.driver.ray_trainer import run_training

    cfg = load_config(sweep_dir / "best.yaml", ["train.max_steps=5", f"run.runs_dir={tmp_path / 'again'}"])
    trained = run_training(cfg)
    assert trained["steps"] == 5 and trained["eval"]["loss"] < 3.5


def test_a_diverging_trial_is_recorded_as_infeasible_and_the_others_finish(ray_session, data_cache, tmp_path):
    # lr 1000 with AdamW sends the loss to nan within a few steps: the worker raises, the trial fails alone.
    spec = parse_sweep({"base": base(data_cache, tmp_path, max_steps=20),
                        "space": {"train.lr": [3e-3, 1000.0]}, "objective": "eval_loss"})
    rows = run_sweep(spec)["trials"]
    by_lr = {r["params"]["train.lr"]: r for r in rows}
    assert by_lr[3e-3]["status"] == "ok" and by_lr[3e-3]["steps"] == 20
    bad = by_lr[1000.0]
    assert bad["status"] == "infeasible" and bad["eval_loss"] is None
    assert bad["reason"].startswith("TrainingDivergedError: training diverged at step"), bad["reason"]
    sweep_dir = next((tmp_path / "runs").iterdir())
    results = json.loads((sweep_dir / "results.json").read_text())
    assert results["best"] == by_lr[3e-3]["trial"]
    assert yaml.safe_load((sweep_dir / "best.yaml").read_text())["train"]["lr"] == 3e-3


def test_asha_sweep_runs_while_its_metric_is_not_known_yet(ray_session, data_cache, tmp_path, caplog):
    # Reports every 5 steps, first eval at step 10: the first result of each trial has no eval_loss, which
    # ASHA skips (and Tune's strict metric check must not turn into a failed sweep).
    spec = parse_sweep({"base": base(data_cache, tmp_path, max_steps=20, eval_every=10),
                        "space": {"train.lr": [3e-3, 1e-3]}, "objective": "eval_loss",
                        "asha": {"grace_samples": 320, "reduction_factor": 2}})
    rows = run_sweep(spec)["trials"]
    assert {r["status"] for r in rows} <= {"ok", "stopped"} and "ok" in {r["status"] for r in rows}, rows
    assert all(r["eval_loss"] is not None and 0 < r["eval_loss"] < 3.5 for r in rows if r["status"] == "ok")
    assert "NaN or Inf" not in caplog.text and "did not include the specified metric" not in caplog.text
