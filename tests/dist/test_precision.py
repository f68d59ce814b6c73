"""Mixed precision through the real loop (1 gloo rank, tiny sizes: bf16 is ~0.7x and fp16 ~20x slower
than fp32 on this CPU). bf16 trains; fp16 trains with a GradScaler whose state is checkpointed."""

from __future__ import annotations

import json
import math

import pytest

from raydl.train import checkpoint as ckpt
from tests.dist.test_resume_parity import job, worker
from tests.helpers import run_gloo


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision, tmp_path, data_cache):
    overrides = [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", f"train.precision={precision}",
                 "train.max_steps=30", "telemetry.report_every=10", "checkpoint.every_steps=30",
                 "train.eval_batches=1", "telemetry.progress=false", "train.global_batch_size=32",
                 "train.micro_batch_size=16"]
    run_gloo(worker, 1, [job(overrides, tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == precision and math.isfinite(summary["final_loss"])
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    state = json.loads((ckpt.find_latest(tmp_path) / ckpt.STATE_FILE).read_text())
    if precision == "fp16":
        assert state["scaler"]["scale"] > 0 and "_growth_tracker" in state["scaler"]
    else:
        assert state["scaler"] is None
