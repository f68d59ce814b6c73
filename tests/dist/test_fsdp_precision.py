"""bf16 with FSDP2 (2 gloo ranks, a tiny model: bf16 is slow on this CPU): bf16 parameters for compute, fp32
masters, gradients and optimizer states, and gradients within bf16's error of an fp32 single-process reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from raydl.models.blocks import BlockModel
from raydl.parallel.data_parallel import apply_data_parallel
from tests.helpers import run_gloo


def _model() -> BlockModel:
    torch.manual_seed(0)
    return BlockModel({f"b{i}": nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for i in range(2)})


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)


def _bf16_rank(rank: int, world_size: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = apply_data_parallel(_model(), dp_mesh=mesh, wrapper="fsdp", pp_enabled=False,
                                materialize=lambda m: None, precision="bf16")
    x, y = _data()
    x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    seen = []
    hook = model.blocks["b0"][0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    out_t = model(x)
    torch.nn.functional.mse_loss(out_t.float(), y).backward()
    hook.remove()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    grads = {name: p.grad.full_tensor().tolist() for name, p in model.named_parameters()}
    if rank == 0:
        Path(out).write_text(json.dumps({
            "compute_dtype": str(seen[0]), "output_dtype": str(out_t.dtype),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
            "state_dtypes": sorted({str(t.dtype) for s in optimizer.state.values() for k, t in s.items()
                                    if k != "step"}),
            "grads": grads}))
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bf16_fsdp2_computes_in_bf16_and_keeps_fp32_masters(tmp_path):
    out = tmp_path / "result.json"
    run_gloo(_bf16_rank, 2, str(out))
    got = json.loads(out.read_text())
    assert got["compute_dtype"] == "torch.bfloat16" and got["output_dtype"] == "torch.bfloat16"
    assert got["sharded"] and got["param_dtypes"] == got["grad_dtypes"] == got["state_dtypes"] == ["torch.float32"]
    reference = _model()
    x, y = _data()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(torch.tensor(got["grads"][name]), p.grad, rtol=0.05, atol=2e-3)
