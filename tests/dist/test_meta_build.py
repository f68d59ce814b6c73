"""Workers build on meta (raydl.train.model_build, then build_engine as start_worker calls them): the
initial weights are equal to the bit at pp=2 (one and two stages per rank), dp=2 under every wrapper and
dp=1, and a pipeline rank never allocates a tensor of another rank's stages.

One spawned gloo group builds every layout (process start-up dominates on 2 cores)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from raydl.config import DP_WRAPPERS
from raydl.models.choice import choose_model
from raydl.overrides import load_config
from raydl.parallel.materialize import MetaInit
from raydl.train.engines import build_engine
from raydl.train.model_build import build_for_worker
from tests.helpers import run_gloo

META = {"vocab_size": 17, "seq_len": 8}   # 17 rows: FSDP2 shards the embedding and the head unevenly
COMMON = ("model.size=tiny", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seed=3")
PIPELINES = {"pp2": ("parallel.pp_degree=2", "parallel.schedule=1f1b"),
             # two stages per rank, each wrapped for activation checkpointing before it is allocated
             "pp2-interleaved": ("parallel.pp_degree=2", "parallel.schedule=interleaved1f1b",
                                 "parallel.num_microbatches=4", "model.activation_checkpointing=true")}
LAYOUTS = {**PIPELINES, **{f"dp2-{w}": (f"parallel.dp_wrapper={w}",) for w in DP_WRAPPERS if w != "auto"}}


def _build(sets: tuple[str, ...], rank: int, world_size: int, watch=None, *, common=COMMON, meta=META):
    """(engine, the model's blocks as built on meta); `watch(module)` runs after each materialization."""
    cfg = load_config(None, [*common, *sets])
    chosen = choose_model(cfg.model)
    model, init = build_for_worker(chosen, meta, cfg)
    assert init is not None, f"{cfg.model.name} must build on meta"
    built = dict(model.blocks)

    class Watched(MetaInit):
        def __call__(self, module, device):
            super().__call__(module, device)
            if watch:
                watch(built)

    session = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    engine = build_engine(model, cfg, chosen.spec, session, meta,
                          Watched(init.seed, init.names, init.init_weights, init.source))
    return engine, built


def _state(engine) -> dict[str, torch.Tensor]:
    """Full values by the unsplit model's names (DTensors gathered: every rank calls this in the same order)."""
    return {k.removeprefix("module."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in engine.model.state_dict().items()}


def _real_blocks(blocks: dict) -> set[str]:
    return {name for name, block in blocks.items()
            if any(not t.is_meta for t in (*block.parameters(), *block.buffers()))}


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's tensors (views of one storage count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def _own_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _ranks(rank: int, world_size: int, out_dir: str) -> None:
    for name, sets in LAYOUTS.items():
        seen: list[set[str]] = []   # the blocks holding real tensors after each materialization
        engine, built = _build(sets, rank, world_size, watch=lambda blocks: seen.append(_real_blocks(blocks)))
        if name in PIPELINES:
            mine = set(engine.model.blocks)
            assert seen and all(real <= mine for real in seen), (name, rank, mine, seen)
            assert _real_blocks(built) == mine
            assert _storage_bytes(engine.model) == _own_bytes(engine.model), name
        torch.save(_state(engine), Path(out_dir) / f"{name}.{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_initial_weights_are_equal_to_the_bit_in_every_layout(tmp_path):
    run_gloo(_ranks, 2, str(tmp_path))
    engine, _ = _build((), 0, 1)
    reference = _state(engine)
    for name, sets in LAYOUTS.items():
        ranks = [torch.load(tmp_path / f"{name}.{r}.pt", weights_only=True) for r in range(2)]
        if name in PIPELINES:
            assert not ranks[0].keys() & ranks[1].keys(), name   # a stage holds only its own tensors
        merged = {**ranks[0], **ranks[1]}
        assert merged.keys() == reference.keys(), name
        different = [k for k in reference if any(k in got and not torch.equal(got[k], reference[k]) for got in ranks)]
        assert not different, (name, different)
