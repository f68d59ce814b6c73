"""train.optimizer_in_backward through the real per-worker loop (gloo ranks, DCP checkpoints on disk): each
parameter stepped in backward trains the same model as the ordinary step after backward, reports the same
gradient norm, and resumes from its own checkpoint to the same end."""

from __future__ import annotations

import json

import pytest
import torch

from raydl.train import checkpoint as ckpt
from tests.dist.test_resume_parity import final_params, job, worker
from tests.helpers import run_gloo

STEPS = 6


def _grad_norms(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in records if "grad_norm" in r]


def _assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 1], ids=["fsdp-dp2", "one-worker-accumulating"])
def test_step_in_backward_trains_the_same_model(tmp_path, data_cache, workers):
    # One worker: 4 micro-batches per step, so the hooks must wait for the last one's gradients.
    base = [f"data.cache_dir={data_cache}", "data.builtin_samples=4096", "train.grad_clip=0",
            "train.global_batch_size=16", "train.micro_batch_size=4", "train.warmup_steps=2",
            "telemetry.report_every=1", "checkpoint.every_steps=3", "train.eval_batches=1",
            "telemetry.progress=false", "parallel.dp_wrapper=fsdp", f"train.max_steps={STEPS}"]
    after, inside, resumed = tmp_path / "after", tmp_path / "inside", tmp_path / "resumed"
    run_gloo(worker, workers, [job(base, after), job(base + ["train.optimizer_in_backward=true"], inside)])
    halfway = ckpt.find_latest(inside).parent / ckpt.checkpoint_name(3)
    run_gloo(worker, workers, [job(base + ["train.optimizer_in_backward=true"], resumed, resume_from=halfway)])

    reference = final_params(after)
    _assert_same_model(reference, final_params(inside))
    _assert_same_model(reference, final_params(resumed))
    norms, reference_norms = _grad_norms(inside), _grad_norms(after)
    assert len(norms) == STEPS and all(n > 0 for n in norms)
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    layout = json.loads((inside / "summary.json").read_text())["layouts"][0]
    assert layout["dp_wrapper"] == ("fsdp" if workers == 2 else "none")
