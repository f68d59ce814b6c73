"""Optimizer, learning-rate schedule (a pure function of the step), gradient clipping, and the optimizer step
taken in backward (train.optimizer_in_backward)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raydl.config import TrainSection


def build_optimizer(params, t: TrainSection) -> torch.optim.Optimizer:
    """Over the trainable parameters alone: frozen ones (a LoRA run's base weights) get no state."""
    params = [p for p in params if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    # The fused kernel updates every parameter in a few launches (nanoGPT and torchtitan use it on GPUs);
    # on CPU the foreach default stays, as measured in the benchmarks there.
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                             fused=fused or None)


def lr_at(step: int, t: TrainSection, total_steps: int) -> float:
    """Linear warmup to t.lr, then cosine/linear decay to t.lr * min_lr_ratio at total_steps.

    A pure function of the step, so resuming needs nothing but the step number.
    """
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant" or total_steps <= t.warmup_steps:
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * shape)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params, max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Global gradient norm over all data-parallel shards and pipeline stages; clips if max_norm > 0.

    `get_total_norm` handles FSDP's sharded DTensor gradients; stages hold disjoint
    parameters, so their squared norms add up across the pipeline group (as in torchtitan).
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        total = total.float() ** 2
        dist.all_reduce(total, group=pp_group)
        total = total ** 0.5
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class StepInBackward:
    """Steps parameters as soon as their gradients are final, then drops those gradients, so no rank ever holds
    all of its gradients at once (train.optimizer_in_backward; torchtitan's "optimizer in backward").

    A gradient is final when FSDP2 has reduce-scattered it (fully_shard calls the parameters' post-accumulate-
    grad hooks only on the micro-batch that synchronizes) or, on one unwrapped worker, when autograd accumulated
    it on the last micro-batch (`armed`). The parameters of one `unit` (a block: fully_shard reduces its
    gradients into one buffer at once) are stepped together, in one optimizer call, when the last of them is
    final: one call per parameter cost a GPT-2 on an H200 a third of its throughput, in the optimizer's per-call
    overhead. Any other parameter is a unit of its own. The one optimizer keeps every state, keyed by parameter
    as usual, so checkpoints, the state holder and resumes see an ordinary optimizer. Its global gradient norm
    (no clipping: that would need every gradient at once) is summed as the gradients go by.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 units: Iterable[Iterable[torch.Tensor]] = ()):
        self.optimizer = optimizer
        self.armed = True
        # Indices, not the groups: loading a checkpoint replaces the optimizer's group dicts.
        self._group_of = {p: i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._unit_of = {p: unit for unit in ([p for p in u if p in self._group_of] for u in units) for p in unit}
        self._ready: dict[int, list[torch.Tensor]] = {}   # id of a unit -> its parameters final so far
        self._squares = torch.zeros((), device=device)
        for p in self._group_of:   # for the parameters' lifetime: the option holds for the whole run
            self._unit_of.setdefault(p, [p])
            p.register_post_accumulate_grad_hook(self._final)

    def _final(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        unit = self._unit_of[param]
        ready = self._ready.setdefault(id(unit), [])
        ready.append(param)
        if len(ready) == len(unit):
            self._step(self._ready.pop(id(unit)))

    def _step(self, params: list[torch.Tensor]) -> None:
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        self._squares += torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(self._group_of[p], []).append(p)
        step_only(self.optimizer, by_group)
        for p in params:
            p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """After backward: steps what is left of a unit some of whose parameters had no gradient, and returns
        the step's global gradient norm over every shard; resets for the next step."""
        for params in self._ready.values():
            self._step(params)
        self._ready.clear()
        total, self._squares = self._squares, torch.zeros_like(self._squares)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total.sqrt()


def step_only(optimizer: torch.optim.Optimizer, params_by_group: dict[int, list[torch.Tensor]], **overrides) -> None:
    """Step only these parameters: the optimizer steps groups of them alone, each with the hyper-parameters (this
    step's lr included) of the group (an index) it belongs to; `overrides` replace some."""
    everything = optimizer.param_groups
    optimizer.param_groups = [{**everything[g], **overrides, "params": ps} for g, ps in params_by_group.items()]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = everything


@contextlib.contextmanager
def states_one_by_one(optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]):
    """Around torch's get_state_dict / set_state_dict. Given an optimizer without states, torch creates them with
    a zero gradient for every parameter at once and one step (`_init_optim_state`): a transient copy of all the
    parameters the rank owns at every resume, and at every checkpoint of a stateless optimizer (SGD without
    momentum), which never gets states. Here the states are made one parameter at a time (a step with lr 0 and a
    zero gradient, as torch's), and a stateless optimizer lends one small zero gradient, which torch takes for
    "already initialized"."""
    if not isinstance(optimizer, torch.optim.Optimizer):   # get_state_dict's iterable of optimizers (export: none)
        with contextlib.ExitStack() as stack:
            for each in optimizer:
                stack.enter_context(states_one_by_one(each))
            yield
        return
    params = [(p, i) for i, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad]
    if optimizer.state or not params or any(p.grad is not None for p, _ in params):
        yield
        return
    for p, i in params:
        p.grad = torch.zeros_like(p)
        step_only(optimizer, {i: [p]}, lr=0.0)
        p.grad = None
    lender = None if optimizer.state else min((p for p, _ in params), key=lambda p: p.numel())
    if lender is not None:
        lender.grad = torch.zeros_like(lender)
    try:
        yield
    finally:
        if lender is not None:
            lender.grad = None
