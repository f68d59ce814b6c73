"""One data-parallel training step: accumulate over micro-batches, then one optimizer step.

Reads top to bottom; every input is an argument. The pipeline-parallel step lives in
raydl.train.engines.PipelineEngine and returns the same `StepStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from raydl.models.loss import logits_out, loss_terms
from raydl.models.spec import ModelSpec
from raydl.parallel.data_parallel import gradient_sync
from raydl.telemetry.profiler import phase
from raydl.train.optim import StepInBackward
from raydl.train.precision import autocast


@dataclass
class StepStats:
    # This rank's share of the step's loss (the sum of its target tokens' losses times the step's scale, see
    # `forward_backward`; the mean over the ranks that have one is the step's loss), still on the device: the step
    # clock reads it with the grad norm at the next report (raydl.telemetry.step_clock), so that no step waits
    # for the GPU and the next step's kernels queue behind this one's optimizer.
    loss: torch.Tensor | float
    has_loss: bool = True  # False on pipeline stages that never see the loss
    count: torch.Tensor | float = 0.0   # this rank's target tokens (the survivors path weighs replicas by it)


def micro_batches(tensors: dict[str, torch.Tensor], num: int) -> list[dict[str, torch.Tensor]]:
    chunks = {k: v.chunk(num) for k, v in tensors.items()}
    return [{k: v[i] for k, v in chunks.items()} for i in range(num)]


def loss_scale(local_count: torch.Tensor, *, device: torch.device, dp_group=None, dp: int = 1) -> torch.Tensor:
    """What each micro-batch's loss sum is multiplied by before backward, so that the gradient is that of the sum
    over the GLOBAL batch's target tokens over their count, whatever its split (FINETUNE_NOTES: per-rank means
    weigh a token by its rank's count). The count all-reduced once per step over `dp_group` (from the targets,
    before any forward); times `dp` because the data-parallel wrapper averages gradients over the replicas.
    Without a group: this rank's count (one worker, or the survivors path, which reweighs in its all-reduce)."""
    count = local_count.to(device=device, dtype=torch.float32)
    if dp_group is None:
        return 1.0 / count.clamp(min=1)
    dist.all_reduce(count, group=dp_group)
    return dp / count.clamp(min=1)


def forward_backward(model: nn.Module, spec: ModelSpec, loss_fn, batches: list[dict[str, torch.Tensor]], *,
                     scale: torch.Tensor, precision: str, device: torch.device, scaler,
                     in_backward: StepInBackward | None = None) -> StepStats:
    """`loss_fn`: (outputs, targets) -> (sum, count) (raydl.models.loss.model_loss); `scale`: `loss_scale`'s.
    `in_backward`: the optimizer steps each parameter during the last micro-batch's backward."""
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if in_backward:
            in_backward.armed = last
        inputs, targets = (t.to(device, non_blocking=True) for t in spec.inputs_targets(batch))
        kwargs = on_device(spec.model_kwargs(batch), device)
        with gradient_sync(model, enabled=last), autocast(precision, device), phase("forward"):
            loss_sum, _ = loss_fn(model(inputs, **kwargs), targets)
        scaled = loss_sum * scale
        with phase("backward"):
            (scaler.scale(scaled) if scaler else scaled).backward()
        total += scaled.detach()
    return StepStats(loss=total)


def on_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}


def optimizer_step(optimizer: torch.optim.Optimizer, scaler, *, clip) -> torch.Tensor:
    """Unscale (fp16), clip, step, zero. `clip()` returns the global grad norm (a device scalar). With the step
    taken in backward no gradient is left here: step and zero find nothing to do."""
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip()
    if scaler:
        scaler.step(optimizer)       # skips the step if grads overflowed, then lowers the scale
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, spec: ModelSpec, batches, *, precision: str, device: torch.device) -> list[float]:
    """[sum of target losses, targets, batches, correct, counted] on this rank; the head returns logits here."""
    was_training = model.training
    model.eval()
    totals = [0.0, 0, 0, 0, 0]
    with logits_out(model):
        for batch in batches:
            inputs, targets = (t.to(device) for t in spec.inputs_targets(batch))
            with autocast(precision, device):
                out = model(inputs, **on_device(spec.model_kwargs(batch), device))
            totals = add_eval(totals, spec, out, targets)
    model.train(was_training)
    return totals


def add_eval(totals: list[float], spec: ModelSpec, outputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    loss_sum, count = loss_terms(spec.loss, outputs, targets)
    correct, counted = spec.count_correct(outputs, targets)
    return [totals[0] + float(loss_sum), totals[1] + int(count), totals[2] + 1, totals[3] + correct,
            totals[4] + counted]
