"""Pipeline parallelism on torch.distributed.pipelining: a model cut into stages, and their schedule.

    raydl train --set parallel.pp_degree=2 --set parallel.schedule=1f1b --set parallel.num_microbatches=8
    torchrun --nproc-per-node 2 -m raydl.worker --set parallel.pp_degree=2 --set parallel.schedule=zbv

A stage is a `BlockModel` of the block modules it owns (the model's own, never copied: a worker
cuts stages on meta and allocates only its own), so parameter names (`blocks.h3.attn.qkv.weight`)
are the same in every layout and DCP checkpoints reshard freely.
Which stages a rank runs is the schedule's placement (`raydl.parallel.schedules`). Data parallelism
is a function applied to each stage (`pipeline_model(..., parallelize=...)`), as in torchtitan's
`pipeline_llm`. The engine that runs a training step on them is `raydl.train.engines.PipelineEngine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn
if TYPE_CHECKING:   # imported where a pipeline is built: it loads torch._dynamo (~0.5 s of every worker's start)
    from torch.distributed.pipelining import PipelineStage

from raydl.models.blocks import BlockModel
from raydl.parallel import schedules
from raydl.parallel.cost_model import balanced_cuts
from raydl.parallel.layout import Layout

__all__ = ["stage_cuts", "split_stages", "pipeline_model", "sum_tied_grads", "forward_chain"]


def stage_cuts(layout: Layout, num_blocks: int) -> tuple[int, ...]:
    """Manual cuts (parallel.stage_cuts or the planner's) or, without them, equal block counts."""
    if layout.stage_cuts:
        return tuple(layout.stage_cuts)
    return balanced_cuts([1.0] * num_blocks, layout.pp * schedules.get(layout.schedule).stages_per_rank)


def split_stages(model: BlockModel, cuts: tuple[int, ...], indices: tuple[int, ...]) -> list[BlockModel]:
    """One BlockModel per stage index, holding `model`'s own block modules (no copy: on meta they have no
    storage yet, and a stage must never allocate another stage's tensors). `model` keeps only those blocks."""
    names = model.block_names
    edges = (0, *cuts, len(names))
    owned = [names[edges[i]:edges[i + 1]] for i in indices]
    model.keep_blocks([name for keep in owned for name in keep])   # other stages' blocks go (real in a fallback)
    return [BlockModel({name: model.blocks[name] for name in keep}) for keep in owned]


def pipeline_model(model: BlockModel, *, layout: Layout, pp_rank: int, pp_group, device: torch.device,
                   parallelize: Callable[[nn.Module], nn.Module], loss_fn) -> tuple[Any, list[PipelineStage], BlockModel]:
    """(schedule, this rank's stages, a BlockModel holding this rank's blocks under their global names).
    `parallelize` wraps a stage and puts its tensors on `device` (materializes it, when it was built on meta)."""
    from torch.distributed.pipelining import PipelineStage

    indices = schedules.stage_indices(layout.schedule, layout.pp, pp_rank)
    for module in model.modules():   # a tied pair sits on two stages: a copy each, kept equal by `sum_tied_grads`
        if hasattr(module, "untie"):
            module.untie()
    modules = split_stages(model, stage_cuts(layout, len(model.blocks)), indices)
    num_stages = layout.pp * len(indices)
    stages = []
    for index, module in zip(indices, modules):
        # PipelineStage infers activation shapes on the first step (one extra P2P round).
        stages.append(PipelineStage(parallelize(module), index, num_stages, device, group=pp_group))
    cls = schedules.get(layout.schedule).torch_class()
    target = stages[0] if len(stages) == 1 else stages
    # scale_grads=False: loss_fn scales each micro-batch's loss sum itself (by the global target count)
    schedule = cls(target, n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=False)
    # The checkpointed module: the unwrapped blocks (FSDP2 shards them in place), names unchanged.
    holder = BlockModel({name: block for m in modules for name, block in m.blocks.items()})
    holder.tied = model.tied
    return schedule, stages, holder


def sum_tied_grads(model: BlockModel, tied: dict[str, str], *, layout: Layout, pp_rank: int, pp_group) -> None:
    """Each tied pair's two copies (the first and the last stage's) get the sum of their gradients, so that they
    stay equal through every optimizer step (Megatron's embedding all-reduce). On one rank (V schedules): added
    here; on two: exchanged between them over the pipeline group. Under FSDP2 each rank exchanges its shard:
    the two stages' replicas shard the pair alike."""
    owner = schedules.stage_ranks(layout.schedule, layout.pp)
    params = dict(model.named_parameters())
    for copy, source in tied.items():
        mine = [params[n].grad for n in (source, copy) if n in params and params[n].grad is not None]
        if not mine:
            continue
        local = [_local(g) for g in mine]
        if len(local) == 2:
            local[0].add_(local[1])
            local[1].copy_(local[0])
            continue
        peer = owner[-1] if pp_rank == owner[0] else owner[0]
        received = torch.empty_like(local[0])
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, local[0], group=pp_group, group_peer=peer),
                                            dist.P2POp(dist.irecv, received, group=pp_group, group_peer=peer)]):
            work.wait()
        local[0].add_(received)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def forward_chain(x: torch.Tensor, stages: list[PipelineStage], *, layout: Layout, pp_rank: int, pp_group,
                  device: torch.device, kwargs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Run every stage in order, activations sent between ranks; returns the output on the last stage. `kwargs`
    (the model's keywords of this batch, which every rank holds) go to every stage.

    Written by hand because torch 2.13's `schedule.eval()` runs the V schedules' backward-input
    steps anyway and fails ("can't steal_bwd_input"); eval needs no pipelining to be correct.
    """
    mine = {stage.stage_index: stage.submod for stage in stages}
    owner = schedules.stage_ranks(layout.schedule, layout.pp)
    for s, rank in enumerate(owner):
        if rank != pp_rank:
            continue
        if s > 0 and owner[s - 1] != rank:
            x = _recv(owner[s - 1], pp_group, device)
        x = mine[s](x, **(kwargs or {}))
        if s + 1 < len(owner) and owner[s + 1] != rank:
            _send(x, owner[s + 1], pp_group)
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
