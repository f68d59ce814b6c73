"""The checks of a `JobConfig` that no single field's type makes: numeric ranges, choices, fields that must agree,
and the trackers' settings. Each error names the field and the fix. World-size-dependent checks (the global batch
over the data-parallel size, layouts) run when a worker group starts, in `raydl.parallel.mesh`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from raydl.errors import ConfigError

__all__ = ["RANGES", "describe_range", "validate", "check_tracker"]


def _fields(cfg: Any) -> Iterator[tuple[str, dataclasses.Field]]:
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            yield section.name, f


# Allowed range of every numeric field: (lowest, highest, lowest allowed?, highest allowed?).
# None = unbounded on that side; every float must also be finite (NaN compares false with everything).
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "data.builtin_samples": (0, None, False, False), "data.shard_rows": (0, None, False, False),
    "data.eval_fraction": (0, 1, False, False), "data.max_bad_shards": (0, None, True, False),
    "data.prefetch_batches": (0, None, True, False), "data.read_cpus": (0, None, True, False),
    "model.dropout": (0, 1, True, False), "parallel.num_microbatches": (0, None, True, False),
    "train.lr": (0, None, False, False), "train.weight_decay": (0, None, True, False),
    "train.beta1": (0, 1, True, False), "train.beta2": (0, 1, True, False), "train.momentum": (0, 1, True, False),
    "train.warmup_steps": (0, None, True, False), "train.min_lr_ratio": (0, 1, True, True),
    "train.global_batch_size": (0, None, False, False), "train.micro_batch_size": (0, None, False, False),
    "train.max_steps": (0, None, True, False), "train.max_epochs": (0, None, True, False),
    "train.grad_clip": (0, None, True, False), "train.seed": (0, None, True, False),
    "train.host_mmap_threshold_kib": (0, 32768, True, True),   # glibc's largest
    "train.eval_every": (0, None, True, False), "train.eval_batches": (0, None, False, False),
    "checkpoint.every_steps": (0, None, False, False), "checkpoint.keep": (0, None, False, False),
    "checkpoint.memory_every_steps": (0, None, True, False),
    "scaling.min_workers": (0, None, False, False), "scaling.max_workers": (0, None, False, False),
    "scaling.cpus_per_worker": (0, None, False, False), "scaling.gpus_per_worker": (0, None, True, False),
    "scaling.max_failures": (-1, None, True, False), "scaling.resize_check_s": (0, None, False, False),
    "scaling.worker_start_timeout_s": (0, None, False, False), "scaling.fit_timeout_s": (0, None, True, False),
    "scaling.memory_per_worker_gb": (0, None, True, False), "scaling.survivor_timeout_s": (0, None, False, False),
    "telemetry.report_every": (0, None, False, False),
    "telemetry.profile_steps": (0, None, True, False),
}


def describe_range(path: str) -> str:
    low, high, low_ok, high_ok = RANGES[path]
    parts = ([f"{'>=' if low_ok else '>'} {low:g}"] if low is not None else []) + \
            ([f"{'<=' if high_ok else '<'} {high:g}"] if high is not None else [])
    return " and ".join(parts)


def _check_range(path: str, value: float) -> None:
    low, high, low_ok, high_ok = RANGES[path]
    inside = math.isfinite(value) and (low is None or value > low or (low_ok and value == low)) and \
        (high is None or value < high or (high_ok and value == high))
    if not inside:
        need = describe_range(path)
        raise ConfigError(path, f"is {value}, must be a finite number {need}", f"set --set {path}=<a value {need}>")


def validate(cfg: Any) -> None:
    """World-size-independent checks of a JobConfig (which calls this when built: hence no import of it here)."""
    for section, f in _fields(cfg):
        choices = f.metadata.get("choices")
        value = getattr(getattr(cfg, section), f.name)
        if choices and value not in choices:
            raise ConfigError(f"{section}.{f.name}", f"is {value!r}, not one of {', '.join(choices)}",
                              f"pick one of them, e.g. --set {section}.{f.name}={choices[0]}")
        if f"{section}.{f.name}" in RANGES and isinstance(value, (int, float)):
            _check_range(f"{section}.{f.name}", value)
    t, s = cfg.train, cfg.scaling
    if t.max_steps == 0 and t.max_epochs == 0:
        raise ConfigError("train.max_steps", "and train.max_epochs are both 0, so the run would never stop",
                          "set --set train.max_steps=N or --set train.max_epochs=N")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError("train.global_batch_size", f"({t.global_batch_size}) is not a multiple of "
                          f"train.micro_batch_size ({t.micro_batch_size})",
                          "make the global batch a multiple of the micro-batch")
    if s.min_workers > s.max_workers:
        raise ConfigError("scaling.min_workers", f"({s.min_workers}) is larger than scaling.max_workers ({s.max_workers})",
                          f"set --set scaling.max_workers={s.min_workers} or lower min_workers")
    if cfg.data.backend == "ray" and cfg.data.max_bad_shards:
        raise ConfigError("data.max_bad_shards", "needs data.backend=arrow: Ray Data read tasks run apart and "
                          "cannot share one count of skipped shards", "set --set data.backend=arrow, or "
                          "--set data.max_bad_shards=0 to fail on the first bad shard")
    if isinstance(t.host_mmap_threshold_kib, str) and t.host_mmap_threshold_kib != "auto":
        raise ConfigError("train.host_mmap_threshold_kib", f"is {t.host_mmap_threshold_kib!r}",
                          "use 'auto', 0 (glibc's default) or a size in KiB up to 32768")
    _check_in_backward(cfg)
    _check_lora(cfg)
    pp = cfg.parallel.pp_degree
    if not (pp == "auto" or (isinstance(pp, int) and pp >= 1)):
        raise ConfigError("parallel.pp_degree", f"is {pp!r}", "use a positive integer or 'auto'")
    if list(cfg.parallel.stage_cuts) != sorted(set(cfg.parallel.stage_cuts)):
        raise ConfigError("parallel.stage_cuts", f"{cfg.parallel.stage_cuts} is not strictly increasing",
                          "list the block index where each stage after the first begins, in order")


def _check_in_backward(cfg: Any) -> None:
    """What the step in backward cannot do: a global norm before any step, a scaler's all-or-nothing skip, a
    pipeline's per-micro-batch backward, a wrapper whose gradients are reduced after the hook (the survivors
    path, torchft's, is ruled out where it is chosen: raydl.parallel.recovery)."""
    if not cfg.train.optimizer_in_backward:
        return
    conflicts = {"train.grad_clip": (cfg.train.grad_clip != 0, "0"),
                 "train.precision": (cfg.train.precision == "fp16", "bf16"),
                 "parallel.pp_degree": (cfg.parallel.pp_degree != 1, "1"),
                 "parallel.dp_wrapper": (cfg.parallel.dp_wrapper in ("ddp", "replicate"), "fsdp")}
    for path, (conflict, fix) in conflicts.items():
        if conflict:
            section, key = path.split(".")
            raise ConfigError(path, f"is {getattr(getattr(cfg, section), key)!r}, which train.optimizer_in_backward="
                              f"true cannot work with: each block is stepped in backward, as soon as FSDP2 "
                              f"has reduced its gradients", f"set --set {path}={fix}, or "
                              f"--set train.optimizer_in_backward=false")


def _check_lora(cfg: Any) -> None:
    """What LoRA does not compose with, refused before any worker starts."""
    if not cfg.train.lora:
        return
    conflicts = {"train.precision": (cfg.train.precision == "fp8", "bf16", "fp8 swaps the Linear layers for "
                                     "torchao's Float8Linear, which peft cannot wrap"),
                 "train.optimizer_in_backward": (cfg.train.optimizer_in_backward, "false", "it steps whole blocks "
                                                 "as their gradients arrive, and a block's frozen weights have none")}
    for path, (conflict, fix, why) in conflicts.items():
        if conflict:
            section, key = path.split(".")
            raise ConfigError(path, f"is {getattr(getattr(cfg, section), key)!r}, which train.lora cannot work "
                              f"with: {why}", f"set --set {path}={fix}, or leave train.lora empty (full fine-tuning)")


def check_tracker(path: str, settings: dict[str, Any], *, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """A tracker's settings: {} (off), or every required key and only known ones, each a non-empty string."""
    if not settings:
        return
    for key, value in settings.items():
        if key not in required + optional:
            raise ConfigError(f"{path}.{key}", "is not a setting of this tracker",
                              f"use {', '.join(f'{path}.{k}' for k in required + optional)}")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}.{key}", f"is {value!r}, not a non-empty string", f"set --set {path}.{key}=TEXT")
    for key in required:
        if key not in settings:
            raise ConfigError(f"{path}.{key}", "is missing", f"set --set {path}.{key}=..., or leave {path} empty (off)")
