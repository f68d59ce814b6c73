"""Data parallelism as a function applied to a model (or to one pipeline stage).

Default is FSDP2 `fully_shard`: it composes with every torch pipelining schedule when it
does not reshard after forward, whereas classic DDP leaves gradients un-averaged under the
zero-bubble schedules (pytorch/pytorch#144530; reproduced in shared/PIPELINE_NOTES.md 1c).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from raydl.config import BF16_COMPUTE


def apply_data_parallel(model: nn.Module, *, dp_mesh, wrapper: str, pp_enabled: bool,
                        materialize: Callable[[nn.Module], None], precision: str = "fp32",
                        cpu_offload: bool = False) -> nn.Module:
    """Wrap `model` for data parallelism over `dp_mesh` (a 1-D DeviceMesh); no-op for one replica.

    `materialize` puts the model's tensors on the device (allocating and initializing a meta model) where the
    wrapper needs it: before DDP, which broadcasts rank 0's values when it wraps; after FSDP2 and replicate,
    which then allocate only the rows this rank keeps. `precision` bf16: FSDP2 (fully_shard, replicate)
    computes with bf16 copies of the parameters and reduces gradients in fp32 onto fp32 parameters, which the
    optimizer updates (its states stay fp32). `cpu_offload`: fully_shard keeps shards, gradients and optimizer
    states in host memory (GPU only)."""
    if dp_mesh is None or dp_mesh.size() == 1:
        materialize(model)
        return model
    if wrapper == "ddp":   # never with pp > 1: the pipeline's validation refuses it
        materialize(model)
        return DistributedDataParallel(model, process_group=dp_mesh.get_group())
    mp_policy = mixed_precision(precision)
    if wrapper == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        model = replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
        materialize(model)
        return model
    # Per-block sharding lets FSDP overlap each block's all-gather with the previous block's compute.
    # Without PP, resharding after forward saves memory; with PP it would all-gather once per micro-batch.
    # The last block stays gathered (its backward comes next, as torchtitan has it): a chunked loss reads its
    # vocabulary projection's gathered weight after its forward (raydl.models.loss.model_loss).
    shard = {"mesh": dp_mesh, "reshard_after_forward": not pp_enabled, "mp_policy": mp_policy,
             "offload_policy": offload(cpu_offload, dp_mesh.device_type)}
    blocks = _unshared(list(getattr(model, "blocks", {}).values()))   # a tied pair: sharded with the root
    for block in blocks:
        last = block is blocks[-1]
        fully_shard(block, **{**shard, "reshard_after_forward": shard["reshard_after_forward"] and not last})
    # The root holds what no block took alone (a tied pair): gathered until backward, where the loss reads it.
    model = fully_shard(model, **{**shard, "reshard_after_forward": False})
    materialize(model)
    return model


def _unshared(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks that share no parameter with another block (FSDP2 shards a parameter in one group only)."""
    owners: dict[int, int] = {}
    for block in blocks:
        for p in block.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [b for b in blocks if all(owners[id(p)] == 1 for p in b.parameters())]


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16 (and fp8's bf16 layers): bf16 parameters for compute, fp32 gradient reduction (bf16 sums over many
    ranks lose bits)."""
    if precision in BF16_COMPUTE:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()   # fp32, and fp16: autocast with the gradient scaler, fp32 parameters


def offload(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    if device_type != "cuda":
        warnings.warn("train.cpu_offload changes nothing on CPU workers: their parameters, gradients and optimizer "
                      "states are in host memory already", stacklevel=3)
        return OffloadPolicy()
    # Pinned host memory lets the host-device copies of each block run asynchronously.
    return CPUOffloadPolicy(pin_memory=True)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield
