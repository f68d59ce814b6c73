"""One data-parallel training step: accumulate over micro-batches, then one optimizer step.

Reads top to bottom; every input is an argument. The pipeline-parallel step lives in
raydl.train.engines.PipelineEngine and returns the same `StepStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raydl.models.spec import ModelSpec
from raydl.parallel.data_parallel import gradient_sync
from raydl.telemetry.profiler import phase
from raydl.train.optim import StepInBackward
from raydl.train.precision import autocast


@dataclass
class StepStats:
    # Mean training loss over this rank's micro-batches (last stage with PP), still on the device: the step
    # clock reads it with the grad norm at the next report (raydl.telemetry.step_clock), so that no step waits
    # for the GPU and the next step's kernels queue behind this one's optimizer.
    loss: torch.Tensor | float
    has_loss: bool = True  # False on pipeline stages that never see the loss


def micro_batches(tensors: dict[str, torch.Tensor], num: int) -> list[dict[str, torch.Tensor]]:
    chunks = {k: v.chunk(num) for k, v in tensors.items()}
    return [{k: v[i] for k, v in chunks.items()} for i in range(num)]


def forward_backward(model: nn.Module, spec: ModelSpec, batches: list[dict[str, torch.Tensor]], *,
                     precision: str, device: torch.device, scaler, in_backward: StepInBackward | None = None) -> StepStats:
    """`in_backward`: the optimizer steps each parameter during the last micro-batch's backward."""
    losses = []
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if in_backward:
            in_backward.armed = last
        inputs, targets = (t.to(device, non_blocking=True) for t in spec.inputs_targets(batch))
        with gradient_sync(model, enabled=last), autocast(precision, device), phase("forward"):
            loss = spec.loss(model(inputs), targets)
        # Mean over micro-batches here, mean over replicas in the DP all-reduce: the full-batch gradient.
        scaled = loss / len(batches)
        with phase("backward"):
            (scaler.scale(scaled) if scaler else scaled).backward()
        losses.append(loss.detach())
    return StepStats(loss=torch.stack(losses).mean())


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
def evaluate(model: nn.Module, spec: ModelSpec, batches, *, precision: str, device: torch.device) -> tuple[float, int, int, int]:
    """(sum of batch losses, number of batches, correct, counted) on this rank."""
    was_training = model.training
    model.eval()
    loss_sum, n, correct, counted = 0.0, 0, 0, 0
    for batch in batches:
        inputs, targets = (t.to(device) for t in spec.inputs_targets(batch))
        with autocast(precision, device):
            out = model(inputs)
        loss_sum += float(spec.loss(out, targets))
        c, k = spec.count_correct(out, targets)
        n, correct, counted = n + 1, correct + c, counted + k
    model.train(was_training)
    return loss_sum, n, correct, counted
