"""Optimizer, learning-rate schedule (a pure function of the step) and gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raydl.config import TrainSection


def build_optimizer(params, t: TrainSection) -> torch.optim.Optimizer:
    params = list(params)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    # The fused kernel updates every parameter in a few launches (nanoGPT and torchtitan use it on GPUs);
    # on CPU the foreach default stays, as measured in the benchmarks there.
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             fused=fused or None)


def lr_at(step: int, t: TrainSection, total_steps: int) -> float:
    """Linear warmup to t.lr, then cosine/linear decay to t.lr * min_lr_ratio at total_steps.

    A pure function of the step, so resuming needs nothing but the step number.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant" or total_steps <= t.warmup_steps:
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * shape)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params, max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Global gradient norm over all data-parallel shards and pipeline stages; clips if max_norm > 0.

    `get_total_norm` handles FSDP's sharded DTensor gradients; stages hold disjoint
    parameters, so their squared norms add up across the pipeline group (as in torchtitan).
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        total = total.float() ** 2
        dist.all_reduce(total, group=pp_group)
        total = total ** 0.5
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
