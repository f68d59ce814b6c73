"""Runs sharing storage stay apart; a run the cluster can never place fails in seconds; a failed start leaves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydl.driver.ray_trainer import run_training, workers_that_fit
from raydl.errors import ConfigError
from raydl.overrides import load_config

@pytest.mark.slow
def test_two_runs_with_one_basename_and_one_storage_path_keep_their_checkpoints(ray_session, data_cache, tmp_path):
    store = tmp_path / "store"
    sets = [f"data.cache_dir={data_cache}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=2",
            "telemetry.report_every=10", "data.builtin_samples=4096", "train.eval_batches=2",
            "telemetry.progress=false", f"checkpoint.storage_path={store}"]
    first = run_training(load_config(None, [*sets, f"run.dir={tmp_path / 'a' / 'exp'}"]))
    second = run_training(load_config(None, [*sets, f"run.dir={tmp_path / 'b' / 'exp'}", "train.seed=1"]))
    folders = sorted(p.name for p in store.iterdir() if p.is_dir())
    assert len(folders) == 2 and all(f.startswith("exp-") for f in folders)
    for summary in (first, second):
        kept = sorted(p.name for p in Path(summary["checkpoint"]).parent.glob("step_*"))
        assert kept == ["step_00000020", "step_00000030"], (summary["checkpoint"], kept)
        assert summary["restarts"] == [] and summary["steps"] == 30   # the second did not resume the first
    assert Path(first["checkpoint"]).parent != Path(second["checkpoint"]).parent


@pytest.mark.slow
def test_more_workers_than_the_cluster_holds_fails_at_once_and_leaves_no_run_dir(ray_session, data_cache, tmp_path):
    cfg = load_config(None, [f"data.cache_dir={data_cache}", f"run.runs_dir={tmp_path / 'runs'}",
                             "scaling.min_workers=64", "scaling.max_workers=64", "train.global_batch_size=64",
                             "train.micro_batch_size=1",
                             "scaling.memory_per_worker_gb=4"])   # past the memory check: the cluster's turn
    with pytest.raises(ConfigError, match=r"asks for 64 workers of 1 CPU each.*can place only \d+"):
        run_training(cfg)
    assert not list((tmp_path / "runs").iterdir())


def test_workers_that_fit_counts_per_node():
    nodes = [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 1.0}, {"CPU": 8.0, "GPU": 4.0}]
    assert workers_that_fit({"CPU": 2.0}, nodes) == 1 + 0 + 4
    assert workers_that_fit({"CPU": 1.0, "GPU": 1.0}, nodes) == 1 + 0 + 4
    assert workers_that_fit({"CPU": 0.5}, [{"CPU": 2.0}]) == 4
