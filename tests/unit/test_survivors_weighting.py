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
    assert first[-2] != second[-2]   # 3 rows and 5 rows: different counts of targets
    loss, quorum_wanted = unweigh(params, first + second)   # the sum over the live replicas
    assert not quorum_wanted
    assert abs(float(loss) - full_loss) < 1e-6 * full_loss
    for name, p in engine.model.named_parameters():
        assert float((p.grad - expected[name]).norm() / expected[name].norm()) < 1e-6, name


def test_one_replica_asking_for_a_quorum_is_heard_by_all_and_the_buffer_is_reused():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for p in params:
        p.grad = torch.ones_like(p)
    asks = weighed(params, SimpleNamespace(loss=torch.tensor(2.0), count=4.0), quorum_wanted=True)
    quiet = weighed(params, SimpleNamespace(loss=torch.tensor(1.0), count=1.0))
    again = weighed(params, SimpleNamespace(loss=torch.tensor(1.0), count=1.0), out=quiet)
    assert again.data_ptr() == quiet.data_ptr()
    loss, quorum_wanted = unweigh(params, asks + quiet)
    assert quorum_wanted and not unweigh(params, quiet + quiet)[1]
    assert abs(float(loss) - 9 / 5) < 1e-6   # losses weighed by counts: (2 x 4 + 1 x 1) / (4 + 1)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
