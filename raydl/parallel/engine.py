"""An engine = the model laid out over the worker group plus how to run one step on it.

`build_engine` resolves the layout for this world size, builds the mesh and applies the
parallelisms in a fixed order (pipeline split, then data parallelism per stage). The loop
only calls `forward_backward`, `clip`, `evaluate`, `parameters` and `model`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from raydl.config import JobConfig
from raydl.models.blocks import BlockModel
from raydl.models.registry import ModelSpec
from raydl.parallel.data_parallel import apply_data_parallel
from raydl.parallel.mesh import Layout, build_mesh
from raydl.train import step as train_step
from raydl.train.optim import clip_grad_norm


class DataParallelEngine:
    """pp == 1: every rank holds the whole model; gradients averaged over the dp axis."""

    def __init__(self, model: BlockModel, layout: Layout, cfg: JobConfig, spec: ModelSpec, device: torch.device, mesh):
        self.layout, self.spec, self.device, self.precision = layout, spec, device, cfg.train.precision
        if cfg.model.activation_checkpointing:
            apply_activation_checkpointing(model)
        model.to(device)
        self.model = apply_data_parallel(model, dp_mesh=mesh["dp"] if mesh is not None else None,
                                         wrapper=cfg.parallel.dp_wrapper, pp_enabled=False)

    def parameters(self):
        return self.model.parameters()

    def forward_backward(self, tensors: dict[str, torch.Tensor], *, scaler) -> train_step.StepStats:
        batches = train_step.micro_batches(tensors, self.layout.num_microbatches)
        return train_step.forward_backward(self.model, self.spec, batches, precision=self.precision,
                                           device=self.device, scaler=scaler)

    def clip(self, max_norm: float):
        return lambda: clip_grad_norm(self.model.parameters(), max_norm)

    def evaluate(self, batches, *, precision: str) -> dict[str, Any]:
        loss_sum, n, correct, counted = train_step.evaluate(self.model, self.spec, batches, precision=precision,
                                                            device=self.device)
        return reduce_eval(loss_sum, n, correct, counted, self.device)


def reduce_eval(loss_sum: float, n: int, correct: int, counted: int, device: torch.device) -> dict[str, Any]:
    t = torch.tensor([loss_sum, n, correct, counted], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    loss_sum, n, correct, counted = t.tolist()
    return {"loss": loss_sum / max(n, 1), "accuracy": correct / max(counted, 1), "batches": int(n)}


def apply_activation_checkpointing(model: BlockModel) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.blocks.items()):
        model.blocks[name] = checkpoint_wrapper(block)


def choose_layout(model: BlockModel, cfg: JobConfig, spec: ModelSpec, session) -> Layout:
    num_blocks = len(model.blocks)
    if not Layout.needs_profile(cfg):
        return Layout.from_config(cfg, session.world_size, num_blocks=num_blocks)
    from raydl.parallel.profile import device_memory_bytes, shared_profile

    profile = shared_profile(model, spec, cfg, session.device)
    workers_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", session.world_size))
    layout = Layout.from_config(cfg, session.world_size, profile, num_blocks=num_blocks,
                                memory_bytes=device_memory_bytes(session.device, workers_on_host))
    if session.rank == 0:
        print(f"[raydl] pp_degree=auto chose {layout.to_dict()}", flush=True)
    return layout


def build_engine(model: BlockModel, cfg: JobConfig, spec: ModelSpec, session):
    layout = choose_layout(model, cfg, spec, session)
    mesh = build_mesh(layout, session.device.type) if session.world_size > 1 else None
    if layout.pp > 1:
        from raydl.parallel.pipeline import PipelineEngine

        return PipelineEngine(model, layout, cfg, spec, session, mesh)
    return DataParallelEngine(model, layout, cfg, spec, session.device, mesh)
