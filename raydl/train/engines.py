"""An engine = the model laid out over the worker group plus how to run one step on it.

`build_engine` resolves the layout for this world size (`layout_for`), builds the mesh and applies the
parallelisms in a fixed order: LoRA adapters (train.lora), float8 layers (train.precision=fp8), activation
checkpointing, per-block compile, pipeline split, then data parallelism per stage, which materializes a model built
on meta (torchtitan's order: a rank allocates only the tensors it keeps). The loop only talks to an `Engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from raydl.config import JobConfig
from raydl.config_lora import lora_settings
from raydl.models.blocks import BlockModel
from raydl.models.lora import adapter_init, apply_lora
from raydl.models.loss import logits_out, model_loss, target_count
from raydl.models.spec import ModelSpec
from raydl.parallel.compile import CompileStats, apply_compile, choose_compile
from raydl.parallel.data_parallel import apply_data_parallel
from raydl.parallel.float8 import apply_float8, check_device
from raydl.parallel.materialize import MetaInit
from raydl.parallel.layout import Layout
from raydl.parallel.mesh import build_mesh, layout_for, needs_profile
from raydl.parallel.pipeline import forward_chain, pipeline_model, sum_tied_grads
from raydl.parallel.memory_probe import model_memory
from raydl.parallel.profile import memory_budget, shared_profile
from raydl.train import step as train_step
from raydl.train.optim import StepInBackward, clip_grad_norm
from raydl.train.precision import autocast
from raydl.train.step import StepStats

__all__ = ["Engine", "DataParallelEngine", "PipelineEngine", "build_engine"]

log = logging.getLogger(__name__)


class Engine(Protocol):
    layout: Layout
    model: nn.Module          # what checkpoints save and load: parameter names are the same in every layout
    compiled: CompileStats | None   # its blocks' compilation (train.compile), None when eager

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def forward_backward(self, tensors: dict[str, torch.Tensor], *, scaler) -> StepStats: ...

    def clip(self, max_norm: float) -> Callable[[], torch.Tensor]:
        """A function that clips this rank's gradients to a global norm and returns that norm."""

    def evaluate(self, batches: Iterable[dict[str, torch.Tensor]], *, precision: str) -> dict[str, Any]:
        """Loss, accuracy and batch count, reduced over all ranks."""


class DataParallelEngine:
    """pp == 1: every rank holds the whole model; gradients averaged over the dp axis."""

    def __init__(self, model: BlockModel, layout: Layout, cfg: JobConfig, spec: ModelSpec, session, mesh,
                 init: MetaInit | None = None):
        self.layout, self.spec, self.device, self.precision = layout, spec, session.device, cfg.train.precision
        self.loss = model_loss(spec.loss, model)
        self.dp_group = mesh["dp"].get_group() if mesh is not None else None
        self.model = apply_data_parallel(model, dp_mesh=mesh["dp"] if mesh is not None else None,
                                         wrapper=layout.dp_wrapper, pp_enabled=False,
                                         materialize=materializer(init, param_device(cfg, self.device)),
                                         precision=self.precision,
                                         cpu_offload=cfg.train.cpu_offload)
        self.in_backward: StepInBackward | None = None

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def step_in_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on `optimizer` steps the parameters in backward, block by block (train.optimizer_in_backward)."""
        blocks = getattr(self.model, "blocks", {}).values()
        self.in_backward = StepInBackward(optimizer, self.device, units=(list(b.parameters()) for b in blocks))

    def forward_backward(self, tensors: dict[str, torch.Tensor], *, scaler) -> StepStats:
        count = target_count(self.spec.inputs_targets(tensors)[1])
        scale = train_step.loss_scale(count, device=self.device, dp_group=self.dp_group, dp=self.layout.dp)
        batches = train_step.micro_batches(tensors, self.layout.num_microbatches)
        stats = train_step.forward_backward(self.model, self.spec, self.loss, batches, scale=scale,
                                            precision=self.precision, device=self.device, scaler=scaler,
                                            in_backward=self.in_backward)
        return dataclasses.replace(stats, count=count)

    def clip(self, max_norm: float) -> Callable[[], torch.Tensor]:
        if self.in_backward:   # the gradients are gone: their norm was summed as they went by (max_norm is 0)
            return self.in_backward.grad_norm
        return lambda: clip_grad_norm(self.model.parameters(), max_norm)

    def evaluate(self, batches, *, precision: str) -> dict[str, Any]:
        totals = train_step.evaluate(self.model, self.spec, batches, precision=precision, device=self.device)
        return _reduce_eval(totals, self.device)


class PipelineEngine:
    """pp > 1: this rank runs its stage(s) of one pipeline; dp replicas of the pipeline over the mesh's dp axis."""

    def __init__(self, model: BlockModel, layout: Layout, cfg: JobConfig, spec: ModelSpec, session, mesh,
                 init: MetaInit | None = None):
        self.layout, self.spec, self.device, self.precision = layout, spec, session.device, cfg.train.precision
        self.pp_group = mesh["pp"].get_group()
        self.dp_group = mesh["dp"].get_group() if layout.dp > 1 else None
        self.pp_rank = layout.coords(session.rank)[1]
        self.tied = dict(model.tied)
        self.loss_scale = torch.ones((), device=self.device)   # set by each step before its schedule runs
        parallelize = functools.partial(apply_data_parallel, dp_mesh=mesh["dp"], wrapper=layout.dp_wrapper,
                                        pp_enabled=True, materialize=materializer(init, param_device(cfg, self.device)),
                                        precision=self.precision, cpu_offload=cfg.train.cpu_offload)
        self.schedule, self.stages, self.model = pipeline_model(
            model, layout=layout, pp_rank=self.pp_rank, pp_group=self.pp_group, device=self.device,
            parallelize=parallelize, loss_fn=self._micro_batch_loss)
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        self.loss = model_loss(spec.loss, next(s.submod for s in self.stages if s.is_last)) if self.is_last else None

    def _micro_batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """What the schedule backpropagates per micro-batch (it does not rescale: scale_grads=False)."""
        return self.loss(outputs, targets)[0] * self.loss_scale

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def forward_backward(self, tensors: dict[str, torch.Tensor], *, scaler) -> StepStats:
        assert scaler is None, "fp16 with pp > 1 is refused by mesh.validate"
        losses: list[torch.Tensor] = []
        inputs, targets = self.spec.inputs_targets(tensors)
        if self.is_last:   # the last stages' dp group: every replica's last stage
            self.loss_scale = train_step.loss_scale(target_count(targets), device=self.device,
                                                    dp_group=self.dp_group, dp=self.layout.dp)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        # Inputs only where the first stage is, targets only where the last is; the model's keywords (a packed
        # batch's documents) on every stage: the schedule splits them into micro-batches and hands each stage its own.
        args = (inputs,) if self.is_first else ()
        kwargs = train_step.on_device(self.spec.model_kwargs(tensors), self.device)
        with autocast(self.precision, self.device):
            self.schedule.step(*args, target=targets if self.is_last else None,
                               losses=losses if self.is_last else None, return_outputs=False, **kwargs)
        sum_tied_grads(self.model, self.tied, layout=self.layout, pp_rank=self.pp_rank, pp_group=self.pp_group)
        if not self.is_last:
            return StepStats(loss=0.0, has_loss=False)
        return StepStats(loss=torch.stack(losses).detach().sum())

    def clip(self, max_norm: float) -> Callable[[], torch.Tensor]:
        # Stages hold disjoint parameters: squared norms add up over the pipeline group.
        return lambda: clip_grad_norm(self.model.parameters(), max_norm, pp_group=self.pp_group)

    @torch.no_grad()
    def evaluate(self, batches, *, precision: str) -> dict[str, Any]:
        """Forward-only, batch by batch; loss and accuracy on the last stage, reduced over all ranks."""
        self.model.eval()
        totals = [0.0, 0, 0, 0, 0]  # as train_step.evaluate's
        with logits_out(self.model):
            for batch in batches:
                inputs, targets = (t.to(self.device) for t in self.spec.inputs_targets(batch))
                kwargs = train_step.on_device(self.spec.model_kwargs(batch), self.device)
                with autocast(precision, self.device):
                    out = forward_chain(inputs, self.stages, layout=self.layout, pp_rank=self.pp_rank,
                                        pp_group=self.pp_group, device=self.device, kwargs=kwargs)
                if self.is_last:
                    totals = train_step.add_eval(totals, self.spec, out, targets)
        self.model.train()
        return _reduce_eval(totals, self.device)


def _reduce_eval(totals: list[float], device: torch.device) -> dict[str, Any]:
    """The loss over every target token of the evaluation (a token-weighted mean, as in training)."""
    t = torch.tensor(totals, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    loss_sum, count, n, correct, counted = t.tolist()
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / counted if counted else None, "batches": int(n)}


def param_device(cfg: JobConfig, device: torch.device) -> torch.device:
    """Where a rank's parameters live: host memory under FSDP2's CPU offload (torchtitan's init device), else the
    device it computes on."""
    return torch.device("cpu") if cfg.train.cpu_offload else device


def materializer(init: MetaInit | None, device: torch.device) -> Callable[[nn.Module], None]:
    """What puts a (stage's) model on the device: allocate and initialize it when built on meta, else move it."""
    if init is None:
        return lambda module: module.to(device)
    return functools.partial(init, device=device)


def apply_activation_checkpointing(model: BlockModel) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.blocks.items()):
        model.blocks[name] = checkpoint_wrapper(block)


def choose_layout(model: BlockModel, cfg: JobConfig, spec: ModelSpec, session, meta: dict[str, Any],
                  init: MetaInit | None = None) -> Layout:
    """`layout_for` with what its policies choose from: the memory prediction of the model (read on meta)
    against this worker's memory budget, and a profile of the model measured here when the planner chooses pp
    (on a model built on meta: one materialized block at a time)."""
    workers_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", session.world_size))
    sizes = {"num_blocks": len(model.blocks), "memory_bytes": memory_budget(cfg, session.device, workers_on_host),
             "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
             "model_memory": model_memory(model, spec, meta), "device_type": session.device.type}
    real_block = functools.partial(init.real_copy, device=session.device) if init else None
    profile = shared_profile(model, spec, meta, cfg, session.device, real_block) if needs_profile(cfg) else None
    return layout_for(cfg, session.world_size, profile, **sizes)


def build_engine(model: BlockModel, cfg: JobConfig, spec: ModelSpec, session, meta: dict[str, Any],
                 init: MetaInit | None = None, *, survivors: bool = False) -> Engine:
    """`meta`: the dataset's, for the planner's example inputs under pp_degree=auto. `init`: the model is on
    meta; each rank allocates and initializes only what it keeps, once the layout is applied. `survivors`: every
    worker is a replica group of its own (raydl.train.survivors): no mesh and no torch wrapper; torchft's
    Manager sums the gradients over the live workers."""
    lora = lora_settings(cfg.train.lora)
    if lora:   # before everything: every later wrapper sees the adapters, and the planner their trainable size
        targets = apply_lora(model, settings=lora)
        init = adapter_init(init, model) if init else None
        if session.rank == 0:
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            log.info(f"train.lora: rank-{lora.rank} adapters on {len(targets)} modules, {trained:,} trainable "
                     f"parameters ({trained / total:.2%} of {total:,}); the rest frozen")
    layout = choose_layout(model, cfg, spec, session, meta, init)
    if survivors:
        layout = dataclasses.replace(layout, dp_wrapper="torchft", dp_wrapper_reason="one all-reduce per step over "
                                     f"the live workers; {layout.dp_wrapper_reason}")
    mesh = build_mesh(layout, session.device.type) if session.world_size > 1 and not survivors else None
    if cfg.train.precision == "fp8":
        check_device(session.device)
        converted = apply_float8(model, scaling=cfg.train.fp8_scaling)
        if session.rank == 0:
            log.info(f"train.precision=fp8: {converted} Linear layers compute in float8 ({cfg.train.fp8_scaling})")
    if cfg.model.activation_checkpointing:
        apply_activation_checkpointing(model)
    compiled = compile_blocks(model, cfg.train.compile, session)
    engine = (PipelineEngine if layout.pp > 1 else DataParallelEngine)(model, layout, cfg, spec, session, mesh, init)
    engine.compiled = compiled
    return engine


def compile_blocks(model: BlockModel, setting: str, session) -> CompileStats | None:
    """train.compile's choice applied to `model` (after activation checkpointing, before any wrapper), with one
    line on rank 0 when it compiles or falls back to eager."""
    choice = choose_compile(setting, session.device.type)
    if not choice.enabled:
        if session.rank == 0 and choice.unavailable:
            log.warning(choice.why)
        return None
    stats = CompileStats()
    names = apply_compile(model, fallback=choice.fallback)
    if session.rank == 0:
        log.info(f"{choice.why} ({len(names)} of {len(model.blocks)} blocks; the first step compiles them)")
    return stats
