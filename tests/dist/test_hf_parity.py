"""Hugging Face causal LMs (tiny Llama and tiny GPT-2, random init) under raydl's parallelisms, in real gloo
groups: pp=2 gradients equal one process's for gpipe, 1f1b and zbv (and dp=2 x pp=2's for the Llama); dp=2
equals dp=1; a checkpoint saved at pp=2 resumes at dp=2 with the losses of the run that stayed at pp=2, and
exports to transformers with raydl's logits.

The parity checks are raydl's own (tests/dist/test_pipeline_parity.py, tests/dist/test_dp_parity.py) run on
these models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raydl.cli import main
from raydl.driver.prepare import prepare_run
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.loop import train_worker
from tests.dist import test_dp_parity as dp_parity
from tests.dist.test_pipeline_parity import assert_every_schedule_matches
from tests.helpers import run_gloo

LLAMA = ("model.name=hf", "model.options.family=llama", "model.options.layers=4", "model.options.hidden_size=32",
         "model.options.kv_heads=2")
GPT2 = ("model.name=hf", "model.options.family=gpt2", "model.options.layers=4", "model.options.hidden_size=32")
MODELS = {"llama": LLAMA, "gpt2": GPT2}
SCHEDULES = ("gpipe", "1f1b", "zbv")   # zbv: zero-bubble, two stages per rank in a V
GRAD_TOLERANCE = 1e-6


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", MODELS)
def test_pp2_gradients_equal_one_process(family, tmp_path):
    assert_every_schedule_matches(2, dict.fromkeys(SCHEDULES, "fsdp"), tmp_path, MODELS[family])
    worst = {rank.name: json.loads(rank.read_text()) for rank in tmp_path.glob("rank*.json")}
    assert all(diff < GRAD_TOLERANCE for per_rank in worst.values() for diff in per_rank.values()), worst


def _dp_config(model: tuple[str, ...], world_size: int):
    return load_config(None, [*model, "parallel.dp_wrapper=fsdp", f"train.global_batch_size={dp_parity.GLOBAL}",
                              "train.micro_batch_size=4",
                              f"scaling.min_workers={world_size}", f"scaling.max_workers={world_size}",
                              "train.optimizer=sgd", "train.lr=0.1"])


def _dp_replica(rank: int, world_size: int, out_dir: str) -> None:
    for family, model in MODELS.items():
        torch.save(dp_parity.train(_dp_config(model, world_size), world_size, rank), f"{out_dir}/{family}-{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_trains_like_one_process_on_the_full_batch(tmp_path):
    run_gloo(_dp_replica, 2, str(tmp_path))
    for family, model in MODELS.items():
        reference = dp_parity.train(_dp_config(model, 1), 1, 0)
        torch.manual_seed(0)
        initial = choose_model(_dp_config(model, 1).model).build(dp_parity.META).state_dict()
        assert max(float((reference[k] - v).abs().max()) for k, v in initial.items()) > 1e-3, "nothing trained"
        for rank in range(2):
            got = torch.load(tmp_path / f"{family}-{rank}.pt", weights_only=True)
            assert got.keys() == reference.keys()
            for name in reference:
                torch.testing.assert_close(got[name], reference[name], rtol=0, atol=GRAD_TOLERANCE,
                                           msg=lambda m: f"{family} rank {rank} {name}: {m}")


K = 3   # steps before and after the change of layout


def _run_jobs(rank: int, world_size: int, jobs: list[dict]) -> None:
    for job in jobs:
        train_worker(job)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "step" in r}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_checkpoint_resumes_at_dp2_with_equal_loss_and_exports(tmp_path, tiny_overrides):
    base = [o for o in tiny_overrides if not o.startswith(("train.max_steps", "checkpoint.every_steps"))]
    base += [f"train.max_steps={2 * K}", f"checkpoint.every_steps={K}", "checkpoint.keep=3", "telemetry.report_every=1",
             "train.global_batch_size=16", "train.micro_batch_size=4", "scaling.min_workers=2"]
    pp2 = ["parallel.pp_degree=2", "parallel.schedule=1f1b"]
    stayed = {f: prepare_run(load_config(None, base + list(m) + pp2), run_dir=tmp_path / f"{f}-pp2",
                             launcher="torchrun").job for f, m in MODELS.items()}
    run_gloo(_run_jobs, 2, list(stayed.values()))
    halfway = {f: tmp_path / f"{f}-pp2" / "train" / ckpt.checkpoint_name(K) for f in MODELS}
    moved = [prepare_run(load_config(None, base + list(m)), run_dir=tmp_path / f"{f}-dp2", resume=str(halfway[f]),
                         launcher="torchrun").job for f, m in MODELS.items()]
    run_gloo(_run_jobs, 2, moved)
    for family, model in MODELS.items():
        before, after = _losses(tmp_path / f"{family}-pp2"), _losses(tmp_path / f"{family}-dp2")
        assert sorted(after) == list(range(K + 1, 2 * K + 1)), after
        for step, loss in after.items():
            assert abs(loss - before[step]) < 1e-5, (family, step, loss, before[step])
        assert_export_matches(halfway[family], load_config(None, base + list(model)), tmp_path / f"{family}-hf")


def assert_export_matches(checkpoint: Path, cfg, out: Path, source: Path | None = None) -> None:
    """`raydl export` of a checkpoint of any layout (or of `source`, the run directory whose newest checkpoint it is),
    against raydl's whole model (config `cfg`) loaded from it in this process."""
    from transformers import AutoModelForCausalLM

    assert main(["export", str(source or checkpoint), "--format", "hf", "--out", str(out)]) == 0
    choice = choose_model(cfg.model)
    meta = choice.open_dataset(cfg).meta
    torch.manual_seed(1)   # unlike the run's init: only the checkpoint can make the two agree
    ours = choice.build(meta)
    ckpt.load(checkpoint, ours, [], choice.fingerprint(ours))
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.randint(0, meta["vocab_size"], (4, meta["seq_len"]), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ours.eval()(ids), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dp2_pp2_gradients_equal_one_process(tmp_path):
    assert_every_schedule_matches(4, dict.fromkeys(("1f1b", "zbv"), "fsdp"), tmp_path, LLAMA)
