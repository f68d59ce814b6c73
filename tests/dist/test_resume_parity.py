"""Resume parity: K steps, stop, resume, K more == 2K straight (CPU, deterministic, 2 gloo ranks, dp=2 or pp=2),
through the real per-worker loop and real DCP checkpoints on disk."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raydl.data.dataset import ensure_builtin
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.loop import train_worker
from tests.helpers import run_gloo

K = 6


def job(overrides: list[str], run_dir, resume_from=None) -> dict:
    cfg = load_config(None, overrides)
    return {"config": cfg.to_dict(), "data_path": ensure_builtin(cfg, "tokens"), "run_dir": str(run_dir),
            "run_id": run_dir.name, "resume_from": str(resume_from) if resume_from else None}


def worker(rank: int, world_size: int, jobs: list[dict]) -> None:
    for j in jobs:
        train_worker(j)
    # A torchrun rank runs without Ray: the loop asks whether it is in Ray without importing it (ray, ray.train and
    # pandas: 0.8 s of each rank's start). The ranks fork from a server that never imported ray (tests/helpers.py).
    assert "ray" not in sys.modules, f"rank {rank}: raydl's per-worker loop imported ray outside Ray"


def final_params(run_dir) -> dict[str, torch.Tensor]:
    path = ckpt.find_latest(run_dir)
    out = run_dir / "full.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.slow
# pp2: each stage's optimizer state and hyperparameters come back under its own parameter names (a nested
# optimizer state dict saved one stage's names for both: its first step after the resume failed).
@pytest.mark.parametrize("layout", [[], ["parallel.pp_degree=2", "parallel.num_microbatches=2"]], ids=["dp2", "pp2"])
def test_resume_equals_straight_run(tmp_path, data_cache, layout):
    # A constant schedule: the K-step run's lr must not depend on its own (shorter) max_steps.
    base = [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.lr_schedule=constant",
            "train.warmup_steps=0", "telemetry.report_every=3", "checkpoint.every_steps=3", "train.eval_batches=1",
            "telemetry.progress=false", *layout]
    straight, first, second = tmp_path / "straight", tmp_path / "first", tmp_path / "second"
    jobs = [job(base + [f"train.max_steps={2 * K}"], straight),
            job(base + [f"train.max_steps={K}"], first)]
    run_gloo(worker, 2, jobs)
    run_gloo(worker, 2, [job(base + [f"train.max_steps={2 * K}"], second, resume_from=ckpt.find_latest(first))])

    state = json.loads((ckpt.find_latest(second) / ckpt.STATE_FILE).read_text())
    assert state["step"] == 2 * K and state["position"]["offset"] == 2 * K * 64
    a, b = final_params(straight), final_params(second)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    halfway = final_params(first)
    assert any(not torch.equal(halfway[n], a[n]) for n in a), "the second half changed nothing"
    summary = json.loads((second / "summary.json").read_text())
    assert summary["steps"] == 2 * K and summary["world_sizes"] == [2]
    assert summary["layouts"][0]["pp"] == (2 if layout else 1)
