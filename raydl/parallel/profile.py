"""What the planner plans from: each block's time, memory and output size, measured on this device.

    raydl plan --workers 4                       # the table of candidate layouts, without training
    raydl train --set parallel.pp_degree=auto

Each block runs forward and backward on a real micro-batch of `train.micro_batch_size`
samples (timing: best of a few runs), and its saved-for-backward activations are counted
with autograd's saved-tensor hooks. Under a process group, rank 0 profiles and broadcasts,
so every rank plans from the same numbers and picks the same layout.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from raydl.config import JobConfig
from raydl.errors import LayoutError
from raydl.models.blocks import BlockModel
from raydl.models.spec import ModelSpec
from raydl.parallel.schedules import require_positive
from raydl.train.precision import autocast

RealBlock = Callable[[torch.nn.Module], torch.nn.Module]   # a block built on meta -> a real copy of it

__all__ = ["BlockProfile", "ModelProfile", "profile_model", "shared_profile", "device_memory_bytes", "memory_budget"]


@dataclass(frozen=True)
class BlockProfile:
    name: str
    fwd_s: float  # forward seconds for ONE micro-batch of `profile.micro_batch` samples
    bwd_s: float  # backward seconds (input grad + weight grad) for the same micro-batch
    param_bytes: int
    activation_bytes: int  # activation memory kept for backward per micro-batch
    output_bytes: int  # bytes of the block's output per micro-batch (what crosses a stage boundary)


@dataclass(frozen=True)
class ModelProfile:
    blocks: tuple[BlockProfile, ...]
    micro_batch: int  # samples per micro-batch the profile was measured at
    optimizer_bytes_per_param_byte: float = 2.0  # AdamW: 2 fp32 states per param
    p2p_bytes_per_s: float = 1e9  # link bandwidth between stages, for the communication term
    p2p_latency_s: float = 1e-4

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.blocks:
            raise LayoutError("the model profile has no blocks; profile at least one block")
        require_positive(micro_batch=self.micro_batch)


_REPEATS = 3


def _time_block(block: torch.nn.Module, x: torch.Tensor, precision: str) -> tuple[float, float, int, torch.Tensor]:
    """(forward s, backward s, saved activation bytes, output) for one block; best of _REPEATS."""
    fwd, bwd, saved = [], [], 0
    for _ in range(_REPEATS):
        inp = x.detach().requires_grad_(x.is_floating_point())
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(precision, x.device):
            out = block(inp)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        saved = sum(sizes)  # parameters saved by matmuls are counted too: a safe overestimate
    return min(fwd), min(bwd), saved, out.detach()


def profile_model(model: BlockModel, spec: ModelSpec, meta: dict[str, Any], *, micro_batch: int, precision: str,
                  device: torch.device, real_block: RealBlock | None = None) -> ModelProfile:
    """Measure each block in execution order, feeding it the previous block's real output. `real_block`: a
    model built on meta is measured on a real copy of one block at a time (never whole on this rank)."""
    if real_block is None:
        model.to(device)
    x = spec.example_inputs(meta, micro_batch).to(device)
    blocks = []
    with torch.random.fork_rng():   # the profile must not shift the training RNG (dropout)
        for name, block in model.blocks.items():
            block = real_block(block) if real_block else block
            fwd_s, bwd_s, act_bytes, x = _time_block(block, x, precision)
            param_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
            blocks.append(BlockProfile(name, fwd_s, bwd_s, param_bytes, act_bytes, x.numel() * x.element_size()))
    model.zero_grad(set_to_none=True)
    return ModelProfile(blocks=tuple(blocks), micro_batch=micro_batch)


def shared_profile(model: BlockModel, spec: ModelSpec, meta: dict[str, Any], cfg: JobConfig,
                   device: torch.device, real_block: RealBlock | None = None) -> ModelProfile:
    """Rank 0's profile on every rank: timings differ between ranks, layouts must not."""
    measure = functools.partial(profile_model, model, spec, meta, micro_batch=cfg.train.micro_batch_size,
                                precision=cfg.train.precision, device=device, real_block=real_block)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return measure()
    box = [measure() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def device_memory_bytes(device: torch.device, workers_on_host: int) -> int:
    """GPU memory of `device`, or this host's RAM shared by the workers running on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, workers_on_host)


def memory_budget(cfg: JobConfig, device: torch.device, workers_on_host: int) -> int:
    """What one worker's predicted peak must fit: scaling.memory_per_worker_gb, else `device_memory_bytes`."""
    if cfg.scaling.memory_per_worker_gb:
        return int(cfg.scaling.memory_per_worker_gb * 2**30)
    return device_memory_bytes(device, workers_on_host)
