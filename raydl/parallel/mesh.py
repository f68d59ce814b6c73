"""The layout of a worker group: data-parallel × pipeline degrees and the batch arithmetic.

Resolved at every worker-group start from the config and the world size, so a resized
group gets a new layout while the global batch stays the same
(global = micro-batch × accumulation (or pipeline micro-batches) × dp). `build_mesh` is
the only torch.distributed call here.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

from raydl.config import JobConfig
from raydl.errors import LayoutError


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    pp: int
    micro_batch: int          # samples per forward on one rank
    num_microbatches: int     # per optimizer step and replica (gradient accumulation when pp == 1)
    schedule: str = "none"
    stage_cuts: tuple[int, ...] = ()

    @property
    def global_batch(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch

    @property
    def per_replica_batch(self) -> int:
        return self.num_microbatches * self.micro_batch

    def coords(self, rank: int) -> tuple[int, int]:
        """rank -> (dp_rank, pp_rank); pp is the inner axis so a pipeline's stages are neighbours."""
        return rank // self.pp, rank % self.pp

    def to_dict(self) -> dict:
        return asdict(self)


def batch_split(*, global_batch: int, micro_batch: int, dp: int, strict: bool,
                num_microbatches: int = 0) -> tuple[int, int]:
    """(micro_batch, num_microbatches) with dp × m × micro == global_batch, exactly if possible.

    With `strict` (a fixed-size run) an inexact split is an error; in an elastic run the
    closest smaller global batch is used and a warning gives the numbers.
    """
    per_replica = global_batch // dp
    if num_microbatches:
        m = num_microbatches
    else:   # fewest micro-batches of at most micro_batch samples that cover the most of per_replica
        first = max(1, math.ceil(per_replica / micro_batch))
        m = max(range(first, max(first, per_replica) + 1), key=lambda k: (k * (per_replica // k), -k))
    micro = per_replica // m
    if micro == 0:
        raise LayoutError(f"parallel.num_microbatches={m} is more than the {per_replica} samples each of the {dp} "
                          f"replicas gets per step. Fix: lower parallel.num_microbatches or raise train.global_batch_size.")
    effective = dp * m * micro
    if effective != global_batch:
        msg = (f"train.global_batch_size={global_batch} cannot be split exactly over {dp} data-parallel replicas "
               f"with micro-batches of at most {micro_batch} ({m} x {micro} per replica)")
        if strict:
            raise LayoutError(f"{msg}. Fix: make train.global_batch_size a multiple of "
                              f"{dp} x train.micro_batch_size (e.g. {dp * m * micro_batch}), or change the workers.")
        warnings.warn(f"{msg}; training with a global batch of {effective} while the world size is "
                      f"{dp} replicas (it returns to {global_batch} when the world size allows).", stacklevel=2)
    return micro, m


def resolve_layout(cfg: JobConfig, *, world_size: int, num_blocks: int, pp: int | None = None) -> Layout:
    """Layout for a fixed pp degree (`pp` or cfg.parallel.pp_degree); 'auto' is the planner's job."""
    pp = pp if pp is not None else cfg.parallel.pp_degree
    assert isinstance(pp, int), "pp_degree='auto' must be resolved by the planner first"
    if pp > num_blocks:
        raise LayoutError(f"parallel.pp_degree={pp} is larger than the model's {num_blocks} blocks. "
                          f"Fix: use parallel.pp_degree <= {num_blocks}.")
    if world_size % pp:
        raise LayoutError(f"the world size {world_size} is not divisible by parallel.pp_degree={pp}. "
                          f"Fix: use a pp degree that divides the number of workers, or pp_degree=auto.")
    dp = world_size // pp
    strict = cfg.scaling.min_workers == cfg.scaling.max_workers
    micro, m = batch_split(global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
                           dp=dp, strict=strict, num_microbatches=cfg.parallel.num_microbatches if pp > 1 else 0)
    return Layout(world_size=world_size, dp=dp, pp=pp, micro_batch=micro, num_microbatches=m,
                  schedule=cfg.parallel.schedule if pp > 1 else "none",
                  stage_cuts=tuple(cfg.parallel.stage_cuts))


def build_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
