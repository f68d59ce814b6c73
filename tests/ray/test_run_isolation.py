"""A run the cluster can never place fails in seconds; a failed start leaves nothing. (Runs sharing storage stay apart:
tests/ray/test_pipeline_train.py, on its two runs.)"""

from __future__ import annotations

import pytest

from raydl.driver.ray_trainer import run_training, workers_that_fit
from raydl.errors import ConfigError
from raydl.overrides import load_config


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
