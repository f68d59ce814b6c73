"""`raydl train` on Ray Train with pipeline layouts: an explicit pp=2 schedule of the tiny GPT, and a tiny Hugging Face
GPT-2 (`model.name=hf`) at the layout the planner chooses (pp_degree=auto). The two runs also share one storage path
and one run basename (`exp`): they keep their checkpoints apart (one pair of runs for all three checks: each run costs
~35 CPU-s of process starts; the GPT-2 run was tests/ray/test_hf_train.py's own until 2026-12-06)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydl.driver.ray_trainer import run_training
from raydl.overrides import load_config

pytestmark = pytest.mark.slow

EXPLICIT = ("parallel.pp_degree=2", "parallel.schedule=interleaved1f1b", "parallel.num_microbatches=4")
AUTO = ("parallel.pp_degree=auto", "model.name=hf", "model.options.family=gpt2", "model.options.layers=3",
        "model.options.hidden_size=32")


@pytest.fixture(scope="module")
def runs(ray_session, data_cache, tmp_path_factory) -> dict:
    """layout -> summary: the two layouts' runs, one after the other, in a/exp and b/exp with one storage path."""
    root = tmp_path_factory.mktemp("pipelines")
    sets = [f"data.cache_dir={data_cache}", "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep=2",
            "telemetry.report_every=10", "data.builtin_samples=4096", "train.eval_batches=2",
            "telemetry.progress=false", f"checkpoint.storage_path={root / 'store'}"]
    return {EXPLICIT: run_training(load_config(None, [*sets, *EXPLICIT, f"run.dir={root / 'a' / 'exp'}"])),
            AUTO: run_training(load_config(None, [*sets, *AUTO, f"run.dir={root / 'b' / 'exp'}", "train.seed=1"])),
            "store": root / "store"}


@pytest.mark.parametrize("layout", [EXPLICIT, AUTO], ids=["pp2-interleaved", "auto"])
def test_pipeline_trains_on_ray(layout, runs):
    summary = runs[layout]
    assert summary["steps"] == 30
    assert summary["final_loss"] < summary["first_loss"]
    (used,) = summary["layouts"]
    assert used["dp"] * used["pp"] == 2
    if layout == EXPLICIT:
        assert (used["pp"], used["schedule"], used["num_microbatches"]) == (2, "interleaved1f1b", 4)
    else:   # the planner's choice for the Hugging Face model: its 3 blocks and the embeddings and head on the stages
        assert load_config(Path(summary["run_dir"]) / "config.yaml").model.options["family"] == "gpt2"
        # parallel.dp_wrapper=auto: DDP when params, grads and optimizer states fit, and the layout says why
        assert used["dp_wrapper"] in ("ddp", "replicate") and "fits in" in used["dp_wrapper_reason"], used
    assert summary["eval"]["batches"] > 0


def test_two_runs_with_one_basename_and_one_storage_path_keep_their_checkpoints(runs):
    first, second = runs[EXPLICIT], runs[AUTO]
    folders = sorted(p.name for p in runs["store"].iterdir() if p.is_dir())
    assert len(folders) == 2 and all(f.startswith("exp-") for f in folders)
    for summary in (first, second):
        kept = sorted(p.name for p in Path(summary["checkpoint"]).parent.glob("step_*"))
        assert kept == ["step_00000020", "step_00000030"], (summary["checkpoint"], kept)
        assert summary["restarts"] == [] and summary["steps"] == 30   # the second did not resume the first
    assert Path(first["checkpoint"]).parent != Path(second["checkpoint"]).parent
