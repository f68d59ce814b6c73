"""DP parity: 2 gloo ranks, each with half the global batch, end with the parameters of one
process trained on the whole batch (fp32), for every data-parallel wrapper.

SGD, because Adam divides by sqrt(v): for gradients that are mathematically zero (the
attention key bias) it turns ~1e-10 summation-order noise into full-size steps, which
would hide what this test checks, the averaging of gradients over replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from raydl.config import DP_WRAPPERS
from raydl.data.builtin import arithmetic_table
from raydl.data.loader import to_tensors
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.parallel.mesh import build_mesh, layout_for
from raydl.train.engines import DataParallelEngine
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer
from raydl.train.step import optimizer_step
from tests.helpers import run_gloo

STEPS, GLOBAL = 3, 16
META = {"vocab_size": 16, "seq_len": 8}


def batches() -> list[dict[str, torch.Tensor]]:
    import numpy as np

    return [to_tensors(arithmetic_table(np.arange(i * GLOBAL, (i + 1) * GLOBAL), seed=7), META) for i in range(STEPS)]


def config(wrapper: str, world_size: int):
    return load_config(None, [f"parallel.dp_wrapper={wrapper}", f"train.global_batch_size={GLOBAL}",
                              "train.micro_batch_size=4", f"scaling.min_workers={world_size}", "train.optimizer=sgd", "train.lr=0.1",
                              f"scaling.max_workers={world_size}", "model.size=tiny"])


def train(cfg, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    chosen = choose_model(cfg.model)
    spec = chosen.spec
    model, init = build_for_worker(chosen, META, cfg)   # as workers build: on meta, allocated once wrapped
    layout = layout_for(cfg, world_size, num_blocks=len(model.blocks))
    mesh = build_mesh(layout, "cpu") if world_size > 1 else None
    session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    engine = DataParallelEngine(model, layout, cfg, spec, session, mesh, init)
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    per_rank = GLOBAL // world_size
    for batch in batches():
        mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
        engine.forward_backward(mine, scaler=None)
        optimizer_step(optimizer, None, clip=engine.clip(cfg.train.grad_clip))
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in engine.model.state_dict().items()}


def replica(rank: int, world_size: int, out_dir: str) -> None:
    for wrapper in DP_WRAPPERS:
        params = train(config(wrapper, world_size), world_size, rank)
        torch.save(params, f"{out_dir}/{wrapper}-rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_match_one_process_on_the_full_batch(tmp_path):
    run_gloo(replica, 2, str(tmp_path))
    for wrapper in DP_WRAPPERS:
        reference = train(config(wrapper, 1), 1, 0)
        for rank in range(2):
            got = torch.load(tmp_path / f"{wrapper}-rank{rank}.pt", weights_only=True)
            got = {k.removeprefix("module."): v for k, v in got.items()}
            assert got.keys() == reference.keys()
            for name in reference:
                torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{wrapper} rank {rank} {name}: {m}")
        moved = max(float((reference[k] - v).abs().max()) for k, v in initial_params().items())
        assert moved > 1e-3, "training did not move the parameters, so the parity check proves nothing"


def initial_params() -> dict[str, torch.Tensor]:
    cfg = config("fsdp", 1)
    model, init = build_for_worker(choose_model(cfg.model), META, cfg)
    init(model, torch.device("cpu"))
    return model.state_dict()
