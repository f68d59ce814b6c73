"""The layout of a worker group: data-parallel × pipeline degrees and the batch arithmetic.

`layout_for` is the one place that turns a config and a world size into dp × pp ×
micro-batches, at every worker-group start, so a resized group gets a new layout while the
global batch stays the same (global = micro-batch × accumulation (or pipeline micro-batches) × dp).
pp is the config's, or with parallel.pp_degree=auto the planner's choice from a profile of the
model. `build_mesh` is the only torch.distributed call here.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from raydl.config import JobConfig
from raydl.errors import LayoutError
from raydl.parallel import constraints, search
from raydl.parallel.batching import batch_split
from raydl.parallel.cost_model import Candidate
from raydl.parallel.layout import Layout
from raydl.parallel.memory import ModelMemory, Setting
from raydl.parallel.memory_fit import check_memory, peak_with
from raydl.parallel.profile import ModelProfile
from raydl.parallel.wrapper_policy import choose_dp_wrapper

__all__ = ["layout_for", "needs_profile", "plan_layouts", "min_micro_batch", "validate", "build_mesh"]


def needs_profile(cfg: JobConfig) -> bool:
    """parallel.pp_degree=auto: the planner chooses from a profile of the model on the device."""
    return cfg.parallel.pp_degree == "auto"


def layout_for(cfg: JobConfig, world_size: int, profile: ModelProfile | None = None, *,
                num_blocks: int, memory_bytes: int = 0, param_bytes: int = 0,
                model_memory: ModelMemory | None = None, device_type: str = "cpu") -> Layout:
    """The layout this world size trains with, validated (LayoutError with the numbers and the fix).

    With pp_degree=auto, `profile` and `memory_bytes` (per worker) are what the planner chooses from;
    with dp_wrapper=auto, `param_bytes` (the model's) and `memory_bytes` choose the wrapper. With
    `model_memory` both choose by the memory prediction (`raydl.parallel.memory`), and a layout whose
    predicted peak exceeds `memory_bytes` is refused with the numbers and the layouts that would fit.
    """
    p = cfg.parallel
    if needs_profile(cfg):
        chosen, _ = plan_layouts(profile, cfg, world_size=world_size, memory_bytes=memory_bytes,
                                 model_memory=model_memory, device_type=device_type)
        pp, schedule, m, cuts = chosen.pp, chosen.schedule, chosen.num_microbatches, chosen.stage_cuts
    else:
        pp, schedule, cuts = p.pp_degree, p.schedule, tuple(p.stage_cuts)
        m = p.num_microbatches if pp > 1 else 0   # 0: the accumulation count follows from the batch sizes
        if pp > 1:
            constraints.check_mesh(num_blocks, world_size, pp, schedule)
    dp = world_size // pp
    micro, m = batch_split(global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
                           dp=dp, strict=not _elastic(cfg), num_microbatches=m)
    pipelined = pp > 1
    layout = Layout(world_size=world_size, dp=dp, pp=pp, micro_batch=micro, num_microbatches=m,
                    schedule=schedule if pipelined else "none", stage_cuts=cuts if pipelined else ())
    predicted = None if model_memory is None else functools.partial(
        peak_with, layout, model_memory, Setting.from_config(cfg, device_type), device_type)
    wrapper, why = choose_dp_wrapper(p.dp_wrapper, dp=dp, pp=pp, param_bytes=param_bytes,
                                     memory_bytes=memory_bytes, predicted=predicted,
                                     in_backward=cfg.train.optimizer_in_backward)
    layout = replace(layout, dp_wrapper=wrapper, dp_wrapper_reason=why)
    validate(layout, num_blocks=num_blocks, precision=cfg.train.precision, dp_wrapper=wrapper,
             cpu_offload=cfg.train.cpu_offload)
    if model_memory is not None and memory_bytes:
        check_memory(layout, cfg, model_memory, memory_bytes=memory_bytes, device_type=device_type)
    return layout


def _elastic(cfg: JobConfig) -> bool:
    """A run whose world size may change trains at the closest smaller global batch when a size does not split it."""
    return cfg.scaling.min_workers != cfg.scaling.max_workers


def min_micro_batch(cfg: JobConfig) -> int:
    # The planner scales time linearly with the micro-batch, so it favours tiny micro-batches that real
    # kernels run inefficiently; stay within 4x of the size the profile was measured at.
    return max(1, cfg.train.micro_batch_size // 4)


def plan_layouts(profile: ModelProfile, cfg: JobConfig, *, world_size: int, memory_bytes: int,
                 model_memory: ModelMemory | None = None,
                 device_type: str = "cpu") -> tuple[Candidate, list[Candidate]]:
    """(chosen, candidates): the planner's best fitting candidate whose micro-batch is >= min_micro_batch.
    An explicit pp_degree restricts the search to it and the configured schedule. With `model_memory`, a
    candidate must also fit by the memory prediction (with the wrapper dp_wrapper would give it)."""
    p = cfg.parallel
    auto = needs_profile(cfg)
    if p.stage_cuts and not auto:
        constraints.validate_stage_cuts(p.stage_cuts, num_blocks=len(profile.blocks), pp=p.pp_degree,
                                        schedule=p.schedule)
    _, candidates = search.plan(profile, world_size=world_size, global_batch=cfg.train.global_batch_size,
                                device_memory_bytes=memory_bytes, pp=p.pp_degree,
                                schedule="auto" if auto else p.schedule, num_microbatches=p.num_microbatches or None,
                                stage_cuts=p.stage_cuts or None, allow_smaller_batch=_elastic(cfg))
    floor = min_micro_batch(cfg)
    usable = [c for c in candidates if c.fits and c.micro_batch >= floor
              and _predicted_fit(c, cfg, model_memory, memory_bytes, device_type)]
    if not usable:
        raise LayoutError(
            f"no layout of {world_size} workers fits with a micro-batch of at least {floor} samples "
            f"(train.micro_batch_size={cfg.train.micro_batch_size} // 4); the best fitting one is "
            f"{search.describe(candidates[0])}. Fix: lower train.micro_batch_size, or set parallel.pp_degree explicitly.")
    return usable[0], candidates   # candidates come sorted best first


def _predicted_fit(candidate: Candidate, cfg: JobConfig, model_memory: ModelMemory | None, memory_bytes: int,
                   device_type: str) -> bool:
    if model_memory is None or not memory_bytes:
        return True
    layout = Layout(world_size=candidate.dp * candidate.pp, dp=candidate.dp, pp=candidate.pp,
                    micro_batch=candidate.micro_batch, num_microbatches=candidate.num_microbatches,
                    schedule=candidate.schedule if candidate.pp > 1 else "none",
                    stage_cuts=candidate.stage_cuts if candidate.pp > 1 else ())
    setting = Setting.from_config(cfg, device_type)
    options = ["fsdp"] if cfg.parallel.dp_wrapper == "auto" else [cfg.parallel.dp_wrapper]
    return any(peak_with(layout, model_memory, setting, device_type, w) <= memory_bytes for w in options)


def validate(layout: Layout, *, num_blocks: int, precision: str, dp_wrapper: str, cpu_offload: bool = False) -> None:
    """Raise LayoutError for a pipeline (pp > 1) torch would reject, or an offload nothing would do, before any
    process group work."""
    if cpu_offload and (layout.dp == 1 or dp_wrapper != "fsdp"):
        raise LayoutError(f"train.cpu_offload=true needs FSDP2 fully_shard over at least 2 data-parallel workers, "
                          f"which offloads its shards; this layout has dp={layout.dp} with wrapper {dp_wrapper!r}. "
                          f"Fix: set parallel.dp_wrapper=fsdp with 2 or more data-parallel workers, or "
                          f"train.cpu_offload=false.")
    if layout.pp == 1:
        return
    constraints.validate_layout(num_blocks=num_blocks, world_size=layout.world_size, pp=layout.pp,
                                schedule=layout.schedule, num_microbatches=layout.num_microbatches,
                                global_batch=layout.global_batch, micro_batch=layout.micro_batch,
                                stage_cuts=layout.stage_cuts or None)
    if dp_wrapper == "ddp" and layout.dp > 1:
        # Zero-bubble schedules bypass DDP's hooks (pytorch/pytorch#144530, PIPELINE_NOTES 1c); with the
        # others torch 2.13's reducer fails an internal assert on the second step.
        raise LayoutError(f"parallel.dp_wrapper=ddp does not work with pipeline parallelism (pp={layout.pp}, "
                          f"dp={layout.dp}): un-averaged gradients with the zero-bubble schedules "
                          f"(pytorch/pytorch#144530) and a reducer failure on the second step with the others. "
                          f"Fix: use parallel.dp_wrapper=auto (default), fsdp or replicate.")
    if precision == "fp16":
        # GradScaler's overflow check is per rank; stages would disagree on skipping a step.
        raise LayoutError(f"train.precision=fp16 is not supported with parallel.pp_degree={layout.pp}: the gradient "
                          f"scaler would skip steps on some stages only. Fix: use train.precision=bf16 (no scaler "
                          f"needed) or fp32.")


def build_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
