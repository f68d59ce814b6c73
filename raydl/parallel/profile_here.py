"""What `raydl plan` plans from: the configured model built and measured on this machine's device.

Shared by `raydl plan` and `raydl bench plan_check`, so the benchmark checks the prediction the command makes.
Measured: the per-block profile (raydl.parallel.profile) and the optimizer step (gradient clipping and
`optimizer.step()` over all parameters, best of a few), which the per-block profile leaves out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from raydl.config import JobConfig
from raydl.models.choice import ModelChoice, choose_model
from raydl.parallel.cluster_plan import Measured
from raydl.parallel.profile import profile_model
from raydl.telemetry.cost import CPU, PriceTable
from raydl.train.optim import build_optimizer

_REPEATS = 3


@dataclass(frozen=True)
class Profiled:
    chosen: ModelChoice
    meta: dict[str, Any]          # the dataset's
    device: torch.device
    measured: Measured


def profile_here(cfg: JobConfig, table: PriceTable | None = None) -> Profiled:
    chosen = choose_model(cfg.model)
    info = chosen.open_dataset(cfg)
    torch.manual_seed(cfg.train.seed)
    model = chosen.build(info.meta, pp_degree=cfg.parallel.pp_degree)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = profile_model(model, chosen.spec, info.meta, micro_batch=cfg.train.micro_batch_size,
                            precision=cfg.train.precision, device=device)
    measured = Measured(profile=profile, device=_device_name(device, table or PriceTable.load()),
                        optimizer_s=_optimizer_s(model, cfg), flops_per_sample=chosen.flops_per_sample(info.meta))
    return Profiled(chosen, info.meta, device, measured)


def _optimizer_s(model: torch.nn.Module, cfg: JobConfig) -> float:
    """Seconds of one optimizer step of the whole model here, with gradient clipping as the loop does it."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(params, cfg.train)
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        if params[0].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return min(times)


def _device_name(device: torch.device, table: PriceTable) -> str:
    if device.type != "cuda":
        return CPU
    name = torch.cuda.get_device_name(device)
    listed = table.accelerator(name)
    return listed.name if listed else name
