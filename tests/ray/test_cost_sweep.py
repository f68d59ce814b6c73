"""A real sweep with objective cost_to_target on the test Ray: every trial's cost is what its run's summary.json
says it spent, and the best trial is the one that reached the target for the fewest dollars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydl.tune.space import parse_sweep
from raydl.tune.sweep import run_sweep


@pytest.mark.slow
def test_cost_to_target_sweep_prices_every_trial(ray_session, data_cache, tmp_path):
    base = {"run": {"runs_dir": str(tmp_path / "runs")},
            "data": {"cache_dir": str(data_cache), "builtin_samples": 4096},
            "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
            "train": {"max_steps": 10, "warmup_steps": 2, "eval_batches": 2},
            "telemetry": {"report_every": 5, "progress": False}, "checkpoint": {"every_steps": 10},
            "cost": {"prices": {"cpu_core": 3600.0}}}          # $1 per core-second: the numbers are readable
    spec = parse_sweep({"base": base, "space": {"train.global_batch_size": [32, 64]}, "objective": "cost_to_target",
                        "target_loss": 3.0})
    summary = run_sweep(spec)
    rows = summary["trials"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    for r in rows:
        run = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert r["cost_usd"] == pytest.approx(run["cost_usd"]) and run["cost_usd"] > 0
        assert 0 < r["cost_to_target_usd"] <= r["cost_usd"]
    best = min(rows, key=lambda r: r["cost_to_target_usd"])
    assert summary["best"] == best["trial"] and summary["metric"] == "cost_to_target_usd"
    assert "cost to target" in summary["table"] and "$" in summary["table"]
