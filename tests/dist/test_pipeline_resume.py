"""Checkpoints are layout-agnostic: a run trained at pp=2 (zbv) loads at pp=1, at dp=2 x pp=1 and at pp=2 (gpipe).
Its head is tied to the embedding (gpt2's): stored once, under the embedding's name, whichever stage wrote it, and
read back into one weight (pp=1) or into both stages' copies (pp=2)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from raydl.data.dataset import open_dataset, resolve_path
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train import checkpoint as ckpt
from raydl.train.engines import build_engine
from raydl.train.loop import train_worker
from raydl.train.optim import build_optimizer
from tests.helpers import run_gloo

STEPS = 4
TIED = {"blocks.head.out.weight": "blocks.embed.tok.weight"}


def _train(rank: int, world_size: int, overrides: list[str], data_path: str, run_dir: str) -> None:
    cfg = load_config(None, overrides)
    train_worker({"config": cfg.to_dict(), "data_path": data_path, "run_dir": run_dir, "run_id": "pipeline-resume",
                  "resume_from": None})


def _load_each(rank: int, world_size: int, layouts: list[list[str]], data_path: str, path: str, full_pt: str) -> None:
    for overrides in layouts:   # one process group for several layouts: spawning costs ~10 s here
        _load_and_compare(rank, world_size, overrides, data_path, path, full_pt)


def _load_and_compare(rank: int, world_size: int, overrides: list[str], data_path: str, path: str,
                      full_pt: str) -> None:
    cfg = load_config(None, overrides)
    chosen = choose_model(cfg.model)
    spec = chosen.spec
    torch.manual_seed(123)                     # a different init: only loading can make the weights equal
    meta = open_dataset(data_path).meta
    model = chosen.build(meta)
    fingerprint = chosen.fingerprint(model)
    session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    engine = build_engine(model, cfg, spec, session, meta)
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    ckpt.load(path, engine.model, optimizer, fingerprint)
    saved = torch.load(full_pt, weights_only=False)["model"]
    names = [TIED.get(n, n) for n, _ in engine.model.named_parameters()]
    assert names and set(names) <= set(saved) and not set(TIED) & set(saved)   # the tied pair stored once
    for name, p in engine.model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(value.detach(), saved[TIED.get(name, name)], rtol=0, atol=0, msg=name)
    blocks = getattr(engine.model, "module", engine.model).blocks
    if "head" in blocks and "embed" in blocks and engine.layout.pp == 1:
        assert blocks["head"].out.weight is blocks["embed"].tok.weight
    assert optimizer.state, "optimizer state (AdamW moments) was loaded too"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_pp2_checkpoint_loads_at_pp1_dp2_and_other_schedule(tiny_overrides, tmp_path):
    base = [o for o in tiny_overrides if not o.startswith(("train.max_steps", "checkpoint.every_steps"))]
    base += [f"train.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}", "model.options.tie_head=true"]
    cfg = load_config(None, base)
    data_path = str(Path(resolve_path(cfg, choose_model(cfg.model).spec.task)).resolve())
    run_dir = tmp_path / "run"
    pp2 = ["parallel.pp_degree=2", "parallel.schedule=zbv", "parallel.num_microbatches=4"]
    run_gloo(_train, 2, base + pp2, data_path, str(run_dir))

    path = ckpt.find_latest(run_dir)
    assert path is not None and path.name == ckpt.checkpoint_name(STEPS)
    full_pt = tmp_path / "full.pt"
    dcp_to_torch_save(path, full_pt)   # the reference: every saved tensor, gathered offline

    run_gloo(_load_each, 1, [base], data_path, str(path), str(full_pt))                               # pp=1
    two_ranks = [base + ["parallel.dp_wrapper=fsdp"],                                                # dp=2 x pp=1
                 base + ["parallel.pp_degree=2", "parallel.schedule=gpipe"]]                         # pp=2, gpipe
    run_gloo(_load_each, 2, two_ranks, data_path, str(path), str(full_pt))
