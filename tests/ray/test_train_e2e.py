"""`raydl train` end to end on a real local Ray: the default config on 2 CPU workers."""

from __future__ import annotations

import json

import pytest

from raydl.overrides import load_config
from raydl.driver.ray_trainer import run_training

SUMMARY_FIELDS = {"steps", "samples", "first_loss", "final_loss", "eval", "samples_per_s", "world_sizes",
                  "restarts", "precision", "wall_s", "checkpoint", "layouts", "data_wait_frac"}


@pytest.mark.slow
def test_default_run_learns_and_resumes(ray_session, data_cache, tmp_path):
    base = [f"data.cache_dir={data_cache}", f"run.runs_dir={tmp_path}", "telemetry.progress=false"]
    summary = run_training(load_config(None, base))          # the default: tiny GPT, 2 workers, 800 steps

    assert SUMMARY_FIELDS <= summary.keys()
    assert summary["steps"] == 800 and summary["samples"] == 800 * 64
    assert summary["final_loss"] <= summary["first_loss"] / 2, summary
    assert summary["eval"]["accuracy"] > 0.9 and summary["eval"]["loss"] < summary["first_loss"] / 2
    assert summary["world_sizes"] == [2] and summary["restarts"] == []
    run_dir = tmp_path / summary["run_dir"].split("/")[-1]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 800 and {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "step_s",
                                  "data_wait_s", "peak_memory_mb"} <= json.loads(lines[-1]).keys()
    assert (run_dir / "config.yaml").exists() and summary["checkpoint"].endswith("step_00000800")

    resumed = run_training(load_config(None, base + ["train.max_steps=810"]), resume=summary["run_dir"])
    records = [json.loads(x) for x in (tmp_path / resumed["run_dir"].split("/")[-1] / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 801 and resumed["steps"] == 810
