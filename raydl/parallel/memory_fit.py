"""Does a layout fit the memory of its workers: the prediction of `raydl.parallel.memory` for a `Layout`, and the
refusal, one paragraph of numbers and the layouts that would fit (`mesh.layout_for` raises it on the driver
before any worker starts, and on the workers)."""

from __future__ import annotations

import warnings
from dataclasses import replace

from raydl.config import JobConfig
from raydl.errors import LayoutError
from raydl.parallel import constraints, memory
from raydl.parallel.layout import Layout
from raydl.parallel.memory import ModelMemory, Setting
from raydl.parallel.batching import batch_split


__all__ = ["predict_memory", "peak_with", "check_memory"]


def peak_with(layout: Layout, model_memory: ModelMemory, setting: Setting, device_type: str, wrapper: str) -> int:
    """The fullest worker's predicted peak, the process included, if `layout` trained with `wrapper`."""
    return predict_memory(replace(layout, dp_wrapper=wrapper), model_memory, setting).with_runtime(device_type)


def predict_memory(layout: Layout, model_memory: ModelMemory, setting: Setting) -> memory.Prediction:
    return memory.predict(model_memory, dp=layout.dp, pp=layout.pp, micro_batch=layout.micro_batch,
                          num_microbatches=layout.num_microbatches, schedule=layout.schedule,
                          stage_cuts=layout.stage_cuts, wrapper=layout.dp_wrapper, setting=setting)


def check_memory(layout: Layout, cfg: JobConfig, model_memory: ModelMemory, *, memory_bytes: int,
                 device_type: str) -> None:
    """Raise LayoutError, one paragraph of numbers and the layouts that would fit, when the predicted peak of
    the fullest worker (the process included) exceeds `memory_bytes`."""
    setting = Setting.from_config(cfg, device_type)
    prediction = predict_memory(layout, model_memory, setting)
    need = prediction.with_runtime(device_type)
    if need <= memory_bytes:
        return
    where = f" (pipeline rank {prediction.fullest})" if layout.pp > 1 else ""
    fitting = _fitting_layouts(cfg, model_memory, layout, layout.world_size, setting, memory_bytes, device_type)
    hint = ("; ".join(fitting) if fitting else
            f"none of the {layout.world_size}-worker layouts fits; "
            f"{_more_workers(cfg, model_memory, layout, setting, memory_bytes, device_type)}, "
            f"a smaller train.micro_batch_size or model, or a larger scaling.memory_per_worker_gb where the workers "
            f"have that memory")
    raise LayoutError(
        f"the layout does not fit in memory: {_layout_words(layout)} needs a predicted {memory.gib(need)} GiB per "
        f"worker{where} ({prediction.breakdown()} for the model, + {memory.mib(memory.RUNTIME_BYTES[device_type])} "
        f"MiB for the process) but has {memory.gib(memory_bytes)} GiB ({_budget_source(cfg, device_type)}). "
        f"Layouts that would fit: {hint}.")


def _budget_source(cfg: JobConfig, device_type: str) -> str:
    if cfg.scaling.memory_per_worker_gb:
        return f"scaling.memory_per_worker_gb={cfg.scaling.memory_per_worker_gb:g}"
    return "the GPU's memory" if device_type == "cuda" else "this node's RAM / the workers on it"


def _layout_words(layout: Layout, ac: bool | None = None) -> str:
    words = f"dp={layout.dp}"
    if layout.dp > 1:
        words += f" ({layout.dp_wrapper})"
    if layout.pp > 1:
        words += f" pp={layout.pp} ({layout.schedule}, m={layout.num_microbatches})"
    words += f" micro-batch {layout.micro_batch}"
    return words + (" with activation checkpointing" if ac else "")


def _fitting_layouts(cfg: JobConfig, model_memory: ModelMemory, refused: Layout, world_size: int, setting: Setting,
                     memory_bytes: int, device_type: str, limit: int = 4) -> list[str]:
    """The leanest layouts of `world_size` workers that fit, as settings to pass: every pp raydl could cut,
    every data-parallel wrapper, with and without activation checkpointing (each a copy of the `refused` one)."""
    num_blocks = len(model_memory.blocks)
    found = []
    for pp in (d for d in constraints.divisors(world_size) if d <= num_blocks):
        schedule = cfg.parallel.schedule if pp > 1 else "none"
        try:
            with warnings.catch_warnings():   # a global batch this dp cannot split exactly: shown as it would run
                warnings.simplefilter("ignore")
                micro, m = batch_split(global_batch=cfg.train.global_batch_size,
                                       micro_batch=cfg.train.micro_batch_size, dp=world_size // pp, strict=False,
                                       num_microbatches=cfg.parallel.num_microbatches if pp > 1 else 0)
        except LayoutError:
            continue
        base = replace(refused, world_size=world_size, dp=world_size // pp, pp=pp, micro_batch=micro,
                       num_microbatches=m, schedule=schedule, stage_cuts=(), dp_wrapper="none", dp_wrapper_reason="")
        wrappers = ["none"] if base.dp == 1 else ["fsdp", "ddp" if pp == 1 else "replicate"]
        for wrapper in wrappers:
            for ac in (False, True):
                layout = replace(base, dp_wrapper=wrapper)
                need = predict_memory(layout, model_memory, replace(setting, activation_checkpointing=ac))
                if need.with_runtime(device_type) <= memory_bytes:
                    found.append((need.peak_bytes, _fix(layout, ac), memory.gib(need.with_runtime(device_type))))
    found.sort()
    return [f"{fix} ({need} GiB)" for _, fix, need in found[:limit]]


def _more_workers(cfg: JobConfig, model_memory: ModelMemory, refused: Layout, setting: Setting, memory_bytes: int,
                  device_type: str, most: int = 1024) -> str:
    """The fewest workers that fit with FSDP2 (the layout that divides everything over dp)."""
    for size in range(refused.world_size + 1, most + 1):
        if _fitting_layouts(cfg, model_memory, refused, size, setting, memory_bytes, device_type, limit=1):
            return f"{size} workers would fit (scaling.min_workers/max_workers={size})"
    return f"no number of workers up to {most} fits"


def _fix(layout: Layout, ac: bool) -> str:
    sets = [f"parallel.pp_degree={layout.pp}"]
    if layout.dp > 1:
        sets.append(f"parallel.dp_wrapper={layout.dp_wrapper}")
    if ac:
        sets.append("model.activation_checkpointing=true")
    return " ".join(f"--set {s}" for s in sets)
