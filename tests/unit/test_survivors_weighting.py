"""The survivors path's one all-reduce keeps the loss token-weighted: two replicas, each with its own count of
targets, averaged as torchft's Manager averages, give the full batch's gradients (raydl.train.survivors)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.parallel.mesh import layout_for
from raydl.train.engines import DataParallelEngine
from raydl.train.model_build import build_for_worker
from raydl.train.survivors import unweigh, weighed
from tests.dist.test_token_weighted import META, ROWS, reference, records


def _replica(cfg, rows: slice):
    chosen = choose_model(cfg.model)
    model, init = build_for_worker(chosen, META, cfg)
    layout = layout_for(cfg, 1, num_blocks=len(model.blocks))
    session = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    engine = DataParallelEngine(model, layout, cfg, chosen.spec, session, None, init)
    stats = engine.forward_backward({k: v[rows] for k, v in records().items()}, scaler=None)
    params = list(engine.model.parameters())
    return engine, params, weighed(params, stats)


def test_two_replicas_of_unequal_counts_average_to_the_full_batch():
    cfg = load_config(None, ["model.size=tiny", f"train.global_batch_size={ROWS // 2}", "train.micro_batch_size=2"])
    full_loss, expected = reference(load_config(None, ["model.size=tiny", f"train.global_batch_size={ROWS}",
                                                       f"train.micro_batch_size={ROWS}"]))
    (engine, params, first), (_, _, second) = _replica(cfg, slice(0, 3)), _replica(cfg, slice(3, ROWS))
    assert first[-1] != second[-1]   # 3 rows and 5 rows: different counts of targets
    loss = unweigh(params, (first + second) / 2)   # the Manager's mean over the live replicas
    assert abs(float(loss) - full_loss) < 1e-6 * full_loss
    for name, p in engine.model.named_parameters():
        assert float((p.grad - expected[name]).norm() / expected[name].norm()) < 1e-6, name
