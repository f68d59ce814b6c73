"""train.compile=true: a tiny GPT with its blocks compiled by Inductor trains to eager's losses under gloo DDP,
FSDP2 (also with the step in backward) and a 2-stage pipeline, 5 AdamW steps each.

One spawned gloo group runs every layout, eager then compiled: the three layouts feed each block micro-batches of
one shape, so Dynamo compiles the block once for the whole test (its cache lives on the block's code).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.train.engines import build_engine
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer
from raydl.train.step import optimizer_step
from tests.helpers import run_gloo

VOCAB, SEQ, ROWS, STEPS = 32, 8, 8, 5
META = {"vocab_size": VOCAB, "seq_len": SEQ}
# Each rank's micro-batches have 2 rows in every layout: dp=2 with 2 micro-batches, or pp=2 with 4.
LAYOUTS = {"ddp": ["parallel.dp_wrapper=ddp", "train.micro_batch_size=2"],
           "fsdp": ["parallel.dp_wrapper=fsdp", "train.micro_batch_size=2"],
           "fsdp-in-backward": ["parallel.dp_wrapper=fsdp", "train.micro_batch_size=2",
                                "train.optimizer_in_backward=true", "train.grad_clip=0"],
           "pp2": ["parallel.pp_degree=2", "parallel.schedule=1f1b", "parallel.num_microbatches=4",
                   "train.micro_batch_size=2"]}


def _batch() -> dict[str, torch.Tensor]:
    """One batch for every step: its loss must fall."""
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)}


def _losses(rank: int, world_size: int, layout_sets: list[str], compile_setting: str) -> tuple[list[float], dict]:
    """The step losses (mean over the ranks that hold one), the engine's compile stats and its model's
    parameter names (what checkpoints hold)."""
    cfg = load_config(None, ["model.size=tiny", f"train.global_batch_size={ROWS}", "scaling.min_workers=2",
                             "scaling.max_workers=2", "train.warmup_steps=0", "train.lr=0.01",
                             f"train.compile={compile_setting}", *layout_sets])
    chosen = choose_model(cfg.model)
    torch.manual_seed(0)
    model, init = build_for_worker(chosen, META, cfg)
    session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    engine = build_engine(model, cfg, chosen.spec, session, META, init)
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    if cfg.train.optimizer_in_backward:
        engine.step_in_backward(optimizer)
    dp_rank, rows = engine.layout.coords(rank)[0], ROWS // engine.layout.dp
    losses = []
    batch = _batch()
    for _ in range(STEPS):
        mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}
        stats = engine.forward_backward(mine, scaler=None)
        optimizer_step(optimizer, None, clip=engine.clip(cfg.train.grad_clip))
        if engine.compiled and engine.compiled.first_step_pending:
            engine.compiled.first_step_done()
        loss = torch.tensor([float(stats.loss), float(stats.has_loss)])
        torch.distributed.all_reduce(loss)
        losses.append(float(loss[0] / loss[1]))
    stats = engine.compiled.to_dict() if engine.compiled else {}
    return losses, {**stats, "names": sorted(engine.model.state_dict())}


def _all_layouts(rank: int, world_size: int, out: str) -> None:
    results = {}
    for name, sets in LAYOUTS.items():
        t0 = time.perf_counter()
        eager, eager_stats = _losses(rank, world_size, sets, "false")
        t1 = time.perf_counter()
        compiled, stats = _losses(rank, world_size, sets, "true")
        assert stats.pop("names") == eager_stats["names"], name   # compiling renames no parameter
        print(f"[compile parity] rank {rank} {name}: eager {t1 - t0:.1f} s, compiled {time.perf_counter() - t1:.1f} s, "
              f"{stats}", flush=True)
        results[name] = {"eager": eager, "compiled": compiled, "stats": stats,
                         "seconds": {"eager": t1 - t0, "compiled": time.perf_counter() - t1}}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.mark.slow
@pytest.mark.timeout(900)   # ~2 minutes on an idle 2-core VM, Inductor's cache warm
def test_compiled_blocks_train_to_eager_losses_under_ddp_fsdp_and_pp(tmp_path):
    out = tmp_path / "losses.json"
    run_gloo(_all_layouts, 2, str(out))
    results = json.loads(out.read_text())
    for name, r in results.items():
        assert len(r["compiled"]) == STEPS and r["compiled"][0] > 0, (name, r)
        torch.testing.assert_close(torch.tensor(r["compiled"]), torch.tensor(r["eager"]), rtol=0, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
        assert r["eager"][-1] < r["eager"][0], (name, r["eager"])   # it trained
        assert r["stats"]["recompiles"] == 0, (name, r["stats"])   # 5 steps of one shape: compiled once
    print({name: (r["stats"], r["seconds"]) for name, r in results.items()})
    assert results["ddp"]["stats"]["graphs"] >= 1   # the first compiled layout compiled the block
