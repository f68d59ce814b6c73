"""Data parallelism as a function applied to a model (or to one pipeline stage).

Default is FSDP2 `fully_shard`: it composes with every torch pipelining schedule when it
does not reshard after forward, whereas classic DDP leaves gradients un-averaged under the
zero-bubble schedules (pytorch/pytorch#144530; reproduced in shared/PIPELINE_NOTES.md 1c).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(model: nn.Module, *, dp_mesh, wrapper: str, pp_enabled: bool,
                        materialize: Callable[[nn.Module], None]) -> nn.Module:
    """Wrap `model` for data parallelism over `dp_mesh` (a 1-D DeviceMesh); no-op for one replica.

    `materialize` puts the model's tensors on the device (allocating and initializing a meta model) where the
    wrapper needs it: before DDP, which broadcasts rank 0's values when it wraps; after FSDP2 and replicate,
    which then allocate only the rows this rank keeps."""
    if dp_mesh is None or dp_mesh.size() == 1:
        materialize(model)
        return model
    if wrapper == "ddp":   # never with pp > 1: the pipeline's validation refuses it
        materialize(model)
        return DistributedDataParallel(model, process_group=dp_mesh.get_group())
    if wrapper == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        model = replicate(model, mesh=dp_mesh)
        materialize(model)
        return model
    # Per-block sharding lets FSDP overlap each block's all-gather with the previous block's compute.
    # Without PP, resharding after forward saves memory; with PP it would all-gather once per micro-batch.
    reshard = not pp_enabled
    for block in getattr(model, "blocks", {}).values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    model = fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    materialize(model)
    return model


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
