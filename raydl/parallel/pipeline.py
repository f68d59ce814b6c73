"""Pipeline parallelism on torch.distributed.pipelining: stages, schedules, the pp > 1 engine.

    raydl train --set parallel.pp_degree=2 --set parallel.schedule=1f1b --set parallel.num_microbatches=8
    torchrun --nproc-per-node 2 -m raydl.worker --set parallel.pp_degree=2 --set parallel.schedule=zbv

A stage is the full `BlockModel` with the blocks it does not own deleted, so parameter names
(`blocks.h3.attn.qkv.weight`) are the same in every layout and DCP checkpoints reshard freely.
Which stages a rank runs is the schedule's placement (`raydl.parallel.schedules`). Data parallelism is a function applied to each stage
(`pipeline_model(..., parallelize=...)`), as in torchtitan's `pipeline_llm`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from raydl.config import JobConfig
from raydl.models.blocks import BlockModel
from raydl.models.registry import ModelSpec
from raydl.parallel import schedules
from raydl.parallel.cost_model import balanced_cuts
from raydl.parallel.data_parallel import apply_data_parallel
from raydl.parallel.mesh import Layout
from raydl.train.optim import clip_grad_norm
from raydl.train.precision import autocast
from raydl.train.step import StepStats

__all__ = ["stage_cuts", "split_stages", "pipeline_model", "PipelineEngine"]


def stage_cuts(layout: Layout, num_blocks: int) -> tuple[int, ...]:
    """Manual cuts (parallel.stage_cuts or the planner's) or, without them, equal block counts."""
    if layout.stage_cuts:
        return tuple(layout.stage_cuts)
    return balanced_cuts([1.0] * num_blocks, layout.pp * schedules.get(layout.schedule).stages_per_rank)


def split_stages(model: BlockModel, cuts: tuple[int, ...], indices: tuple[int, ...]) -> list[BlockModel]:
    """One BlockModel per stage index; a single stage reuses `model`, two get a copy each."""
    names = model.block_names
    edges = (0, *cuts, len(names))
    owned = [names[edges[i]:edges[i + 1]] for i in indices]
    if len(indices) == 1:
        return [model.keep_blocks(owned[0])]
    return [copy.deepcopy(model).keep_blocks(keep) for keep in owned]


def pipeline_model(model: BlockModel, *, layout: Layout, pp_rank: int, pp_group, device: torch.device,
                   parallelize: Callable[[nn.Module], nn.Module], loss_fn) -> tuple[Any, list[PipelineStage], BlockModel]:
    """(schedule, this rank's stages, a BlockModel holding this rank's blocks under their global names)."""
    indices = schedules.stage_indices(layout.schedule, layout.pp, pp_rank)
    modules = split_stages(model, stage_cuts(layout, len(model.blocks)), indices)
    num_stages = layout.pp * len(indices)
    stages = []
    for index, module in zip(indices, modules):
        module.to(device)
        # PipelineStage infers activation shapes on the first step (one extra P2P round).
        stages.append(PipelineStage(parallelize(module), index, num_stages, device, group=pp_group))
    cls = schedules.get(layout.schedule).torch_class()
    target = stages[0] if len(stages) == 1 else stages
    schedule = cls(target, n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    # The checkpointed module: the unwrapped blocks (FSDP2 shards them in place), names unchanged.
    holder = BlockModel({name: block for m in modules for name, block in m.blocks.items()})
    return schedule, stages, holder


class PipelineEngine:
    """pp > 1: this rank runs its stage(s) of one pipeline; dp replicas of the pipeline over the mesh's dp axis."""

    def __init__(self, model: BlockModel, layout: Layout, cfg: JobConfig, spec: ModelSpec, session, mesh):
        self.layout, self.spec, self.device, self.precision = layout, spec, session.device, cfg.train.precision
        if cfg.model.activation_checkpointing:
            from raydl.parallel.engine import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        self.pp_group = mesh["pp"].get_group()
        pp_rank = layout.coords(session.rank)[1]
        parallelize = functools.partial(apply_data_parallel, dp_mesh=mesh["dp"], wrapper=cfg.parallel.dp_wrapper,
                                        pp_enabled=True)
        self.schedule, self.stages, self.model = pipeline_model(
            model, layout=layout, pp_rank=pp_rank, pp_group=self.pp_group, device=session.device,
            parallelize=parallelize, loss_fn=spec.loss)
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        self.pp_rank = pp_rank

    def parameters(self):
        return self.model.parameters()

    def _run(self, tensors: dict[str, torch.Tensor], run, losses: list, precision: str) -> Any:
        """One schedule call: inputs only where the first stage is, targets only where the last is."""
        inputs, targets = (t.to(self.device) for t in self.spec.inputs_targets(tensors))
        args = (inputs,) if self.is_first else ()
        with autocast(precision, self.device):
            return run(*args, target=targets if self.is_last else None, losses=losses if self.is_last else None)

    def forward_backward(self, tensors: dict[str, torch.Tensor], *, scaler) -> StepStats:
        assert scaler is None, "fp16 with pp > 1 is refused by mesh.validate"
        losses: list[torch.Tensor] = []
        # scale_grads=True divides by m: the gradient of the mean micro-batch loss, as in plain DP.
        self._run(tensors, functools.partial(self.schedule.step, return_outputs=False), losses, self.precision)
        if not self.is_last:
            return StepStats(loss=0.0, has_loss=False)
        return StepStats(loss=float(torch.stack(losses).detach().mean()))  # CPU-GPU sync point, once per step

    def clip(self, max_norm: float):
        # Stages hold disjoint parameters: squared norms add up over the pipeline group.
        return lambda: clip_grad_norm(self.model.parameters(), max_norm, pp_group=self.pp_group)

    @torch.no_grad()
    def evaluate(self, batches, *, precision: str) -> dict[str, Any]:
        """Forward-only, batch by batch; loss and accuracy on the last stage, reduced over all ranks."""
        from raydl.parallel.engine import reduce_eval

        self.model.eval()
        totals = [0.0, 0, 0, 0]  # loss sum, batches, correct, counted
        for batch in batches:
            inputs, targets = (t.to(self.device) for t in self.spec.inputs_targets(batch))
            with autocast(precision, self.device):
                out = self._forward_chain(inputs)
            if self.is_last:
                c, k = self.spec.correct(out, targets)
                totals = [totals[0] + float(self.spec.loss(out, targets)), totals[1] + 1, totals[2] + c,
                          totals[3] + k]
        self.model.train()
        return reduce_eval(*totals, self.device)

    def _forward_chain(self, x: torch.Tensor) -> torch.Tensor:
        """Run every stage in order, activations sent between ranks; returns the output on the last stage.

        Written by hand because torch 2.13's `schedule.eval()` runs the V schedules' backward-input
        steps anyway and fails ("can't steal_bwd_input"); eval needs no pipelining to be correct.
        """
        mine = {stage.stage_index: stage.submod for stage in self.stages}
        owner = schedules.stage_ranks(self.layout.schedule, self.layout.pp)
        for s, rank in enumerate(owner):
            if rank != self.pp_rank:
                continue
            if s > 0 and owner[s - 1] != rank:
                x = _recv(owner[s - 1], self.pp_group, self.device)
            x = mine[s](x)
            if s + 1 < len(owner) and owner[s + 1] != rank:
                _send(x, owner[s + 1], self.pp_group)
        return x


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_DIMS = 6


def _send(t: torch.Tensor, dst: int, group) -> None:
    """Blocking send of a tensor of any shape: a fixed-size header (dtype, ndim, shape), then the data."""
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=t.device)
    header[:2] = torch.tensor([_WIRE_DTYPES.index(t.dtype), t.dim()])
    header[2:2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header, group=group, group_dst=dst)
    dist.send(t.contiguous(), group=group, group_dst=dst)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    dtype, ndim = _WIRE_DTYPES[int(header[0])], int(header[1])
    t = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(t, group=group, group_src=src)
    return t
