"""An FSDP2 (DTensor) checkpoint saved by 2 gloo ranks loads through raydl's restricted reader; a
crafted one is refused on every rank (no hang, nothing run) and the group agrees on the previous one."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from raydl.errors import CheckpointError
from raydl.models.gpt import build_gpt
from raydl.train import checkpoint as ckpt
from tests.helpers import raydl_warns, run_gloo
from tests.unit.test_checkpoint_pickle import forge_metadata
from tests.unit.test_checkpoint_safety import tiny_state


def sharded_tiny_gpt(seed: int):
    torch.manual_seed(seed)
    model = fully_shard(build_gpt("tiny", vocab_size=16, seq_len=8), mesh=init_device_mesh("cpu", (2,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def save_two_steps(rank: int, run_dir: Path) -> dict[str, torch.Tensor]:
    model, optimizer = sharded_tiny_gpt(0)
    torch.manual_seed(rank)
    for step in (1, 2):
        model(torch.randint(0, 16, (2, 8))).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            expected = full_params(model)
        ckpt.save(run_dir / ckpt.checkpoint_name(step), model, optimizer,
                  {**tiny_state(step), "saved_by_ranks": 2, "layout": {"world_size": 2}}, rank=rank)
    return expected


def crafted_newest_is_refused(rank: int, world_size: int, run_dir: str) -> None:
    run_dir, marker = Path(run_dir), Path(run_dir) / "pwned"
    expected = save_two_steps(rank, run_dir)
    old, new = run_dir / ckpt.checkpoint_name(1), run_dir / ckpt.checkpoint_name(2)
    dist.barrier()
    assert ckpt.verify(new) is None, "the untouched FSDP2 checkpoint verifies"
    dist.barrier()
    if rank == 0:
        forge_metadata(new, marker)
    dist.barrier()

    said_on_rank_0 = raydl_warns(rf"{new} is not usable.*{old}") if rank == 0 else nullcontext()
    with said_on_rank_0:
        assert ckpt.agree_on_first_valid([str(new), str(old)]) == str(old)
    with pytest.raises(CheckpointError, match=r"asks to build pathlib\.Path\.touch"):
        ckpt.load(new, *sharded_tiny_gpt(9), {"name": "gpt"})

    model, optimizer = sharded_tiny_gpt(9)
    assert ckpt.load(old, model, optimizer, {"name": "gpt"})["step"] == 1
    loaded = full_params(model)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert optimizer.state, "the sharded AdamW moments were loaded too"
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_checkpoint_loads_and_crafted_one_is_refused_on_every_rank(tmp_path):
    run_gloo(crafted_newest_is_refused, 2, str(tmp_path))
    assert not (tmp_path / "pwned").exists()
