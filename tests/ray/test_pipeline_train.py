"""`raydl train` on Ray Train with pipeline layouts: an explicit pp=2 schedule and pp_degree=auto."""

from __future__ import annotations

import pytest

from raydl.overrides import load_config
from raydl.driver.ray_trainer import run_training


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.pp_degree=2", "parallel.schedule=interleaved1f1b", "parallel.num_microbatches=4"],
    ["parallel.pp_degree=auto"],
])
def test_pipeline_trains_on_ray(layout, tiny_overrides, ray_session):
    summary = run_training(load_config(None, tiny_overrides + layout))
    assert summary["steps"] == 20
    assert summary["final_loss"] < summary["first_loss"]
    (used,) = summary["layouts"]
    assert used["dp"] * used["pp"] == 2
    if layout[0] == "parallel.pp_degree=2":
        assert (used["pp"], used["schedule"], used["num_microbatches"]) == (2, "interleaved1f1b", 4)
    assert summary["eval"]["batches"] > 0
