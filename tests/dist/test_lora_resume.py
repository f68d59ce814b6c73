"""LoRA composes with FSDP2, DDP and pipelines, and its checkpoints hold every rank's part of the adapters: a run
trained at dp=2 under FSDP2 (each rank holds half of each adapter) saves the adapters alone; they load whole, to
the bit, at dp=1, at pp=2 and at dp=2 under DDP, and the run resumes at pp=2 and trains on (accelerate#4206 saved only
rank 0's slice, so a resume on N ranks reset (N-1)/N of the adapter). A resume onto other base weights is refused
before any worker starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from raydl.data.dataset import open_dataset, resolve_path
from raydl.driver.lora_base import lora_fingerprint
from raydl.errors import ConfigError
from raydl.models.choice import choose_model
from raydl.models.lora import is_adapter
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.engines import build_engine
from raydl.train.loop import train_worker
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer
from tests.helpers import run_gloo

STEPS = 4
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lr=0.01", "train.warmup_steps=1"]


def _job(overrides: list[str], data_path: str, run_dir: str, resume: str | None = None) -> dict:
    cfg = load_config(None, overrides)
    return {"config": cfg.to_dict(), "data_path": data_path, "run_dir": run_dir, "run_id": "lora-resume",
            "resume_from": resume, "lora_fingerprint": lora_fingerprint(cfg, None)}


def _train(rank: int, world_size: int, overrides: list[str], data_path: str, run_dir: str, resume) -> None:
    train_worker(_job(overrides, data_path, run_dir, resume))


def _load_each(rank: int, world_size: int, layouts: list[list[str]], data_path: str, path: str, full_pt: str) -> None:
    saved = torch.load(full_pt, weights_only=False)
    for overrides in layouts:   # one process group for several layouts: spawning costs ~10 s here
        cfg = load_config(None, overrides)
        chosen = choose_model(cfg.model)
        meta = open_dataset(data_path).meta
        model, init = build_for_worker(chosen, meta, cfg)
        fingerprint = {**chosen.fingerprint(model), **lora_fingerprint(cfg, None)}
        session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
        engine = build_engine(model, cfg, chosen.spec, session, meta, init)
        optimizer = build_optimizer(engine.parameters(), cfg.train)
        ckpt.load(path, engine.model, optimizer, fingerprint)
        adapters = {n.removeprefix("module."): p for n, p in engine.model.named_parameters() if is_adapter(n)}
        assert adapters and all(p.requires_grad for p in adapters.values())
        for name, p in adapters.items():
            value = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(value.detach(), saved["model"][name], rtol=0, atol=0, msg=name)
            assert bool((value != 0).any()), f"{name} is zero: its trained values were not loaded"
        states = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in saved["optim"] if k.startswith("state.")}
        assert states and all(is_adapter(n) for n in states)   # moments saved for the adapters alone
        assert {id(p) for p in optimizer.state} == {id(p) for p in adapters.values()}


def _load_then_resume(rank: int, world_size: int, layouts: list[list[str]], more: list[str], data_path: str,
                      path: str, full_pt: str, resumed: str) -> None:
    """The adapters load whole at each layout, then the run resumes from the FSDP checkpoint and trains on."""
    _load_each(rank, world_size, layouts, data_path, path, full_pt)
    _train(rank, world_size, more, data_path, resumed, path)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lora_fsdp_checkpoint_loads_whole_at_dp1_pp2_ddp_and_resumes_at_pp2(tiny_overrides, tmp_path):
    base = [o for o in tiny_overrides if not o.startswith(("train.max_steps", "checkpoint.every_steps"))]
    base += [f"train.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}", "train.global_batch_size=8",
             "train.micro_batch_size=4", *LORA]
    cfg = load_config(None, base)
    data_path = str(Path(resolve_path(cfg, choose_model(cfg.model).spec.task)).resolve())
    run_dir = tmp_path / "run"
    run_gloo(_train, 2, base + ["parallel.dp_wrapper=fsdp"], data_path, str(run_dir), None)

    path = ckpt.find_latest(run_dir)
    assert path is not None and path.name == ckpt.checkpoint_name(STEPS)
    full_pt = tmp_path / "full.pt"
    dcp_to_torch_save(path, full_pt)   # the reference: every saved tensor, gathered offline
    saved = torch.load(full_pt, weights_only=False)["model"]
    assert saved and all(is_adapter(n) for n in saved)   # the adapters alone, base weights by digest
    assert any(".lora_B." in n and bool((t != 0).any()) for n, t in saved.items())   # trained away from B = 0
    assert ckpt.read_state(path)["model"]["lora_base_digest"] == lora_fingerprint(cfg, None)["lora_base_digest"]

    run_gloo(_load_each, 1, [base], data_path, str(path), str(full_pt))   # dp=1: every rank's part, whole
    pp2 = ["parallel.pp_degree=2", "parallel.num_microbatches=2"]
    more = [o for o in base if not o.startswith("train.max_steps")] + [f"train.max_steps={STEPS + 2}", *pp2]
    resumed = tmp_path / "resumed"
    run_gloo(_load_then_resume, 2, [base + pp2, base + ["parallel.dp_wrapper=ddp"]], more, data_path, str(path),
             str(full_pt), str(resumed))   # then the run goes on in a pipeline of two stages
    resumed_at = ckpt.find_latest(resumed)
    assert resumed_at.name == ckpt.checkpoint_name(STEPS + 2)
    dcp_to_torch_save(resumed_at, tmp_path / "resumed.pt")
    after = torch.load(tmp_path / "resumed.pt", weights_only=False)["model"]
    assert after.keys() == saved.keys() and any(not torch.equal(after[n], saved[n]) for n in saved)

    from raydl.driver.prepare import check_resume
    other_base = load_config(None, [*more, "train.seed=7"])   # the base drawn from another seed
    with pytest.raises(ConfigError, match="'train.init_from'.*base weights"):
        check_resume(str(path), other_base, {"name": "gpt", **lora_fingerprint(other_base, None)}, {}, announce=False)
