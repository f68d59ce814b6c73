"""A plain nn.Module without ModelSpec.blocks trains at pp=1 under every data-parallel wrapper: 2 gloo
ranks, each with half of a fixed batch, lower the loss and end with the same parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import raydl
from raydl.config import DP_WRAPPERS
from raydl.models.build import WHOLE
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.parallel.mesh import build_mesh, layout_for
from raydl.train.engines import DataParallelEngine
from raydl.train.optim import build_optimizer
from raydl.train.step import optimizer_step
from tests.helpers import run_gloo

STEPS, ROWS = 30, 32
SPEC = raydl.ModelSpec(name="plain_mlp", loss=F.mse_loss, inputs_targets=lambda b: (b["x"], b["y"]),
                       build=lambda options, meta: nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)),
                       example_inputs=lambda meta, n: torch.randn(n, 4))


def _batch() -> dict[str, torch.Tensor]:
    x = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(3))
    return {"x": x, "y": x.sum(dim=1, keepdim=True).sin()}


def train(rank: int, world_size: int, out_dir: str) -> None:
    for wrapper in DP_WRAPPERS:
        cfg = load_config(None, [f"parallel.dp_wrapper={wrapper}", f"train.global_batch_size={ROWS}",
                                 f"train.micro_batch_size={ROWS // world_size}", "train.warmup_steps=0",
                                 "train.lr=0.01",
                                 f"scaling.min_workers={world_size}", f"scaling.max_workers={world_size}"])
        chosen = choose_model(cfg.model, SPEC)
        torch.manual_seed(0)
        model = chosen.build({}, pp_degree=cfg.parallel.pp_degree)
        assert model.block_names == [WHOLE]
        layout = layout_for(cfg, world_size, num_blocks=len(model.blocks))
        session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
        engine = DataParallelEngine(model, layout, cfg, SPEC, session, build_mesh(layout, "cpu"))
        optimizer = build_optimizer(engine.parameters(), cfg.train)
        per_rank = ROWS // world_size
        mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in _batch().items()}
        losses = []
        for _ in range(STEPS):
            losses.append(engine.forward_backward(mine, scaler=None).loss)
            optimizer_step(optimizer, None, clip=engine.clip(cfg.train.grad_clip))
        params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in engine.model.state_dict().items()}
        torch.save({"losses": losses, "params": params}, f"{out_dir}/{wrapper}-rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plain_module_trains_with_every_dp_wrapper(tmp_path):
    run_gloo(train, 2, str(tmp_path))
    for wrapper in DP_WRAPPERS:
        ranks = [torch.load(tmp_path / f"{wrapper}-rank{r}.pt", weights_only=True) for r in range(2)]
        for got in ranks:
            assert got["losses"][-1] < 0.6 * got["losses"][0], (wrapper, got["losses"])
        for name, value in ranks[0]["params"].items():
            torch.testing.assert_close(ranks[1]["params"][name], value, msg=lambda m: f"{wrapper} {name}: {m}")
