"""Allocate and initialize only the tensors a rank owns, after its layout is applied (torchtitan's order).

A worker builds its model on `meta` (no storage), cuts its pipeline stage and wraps it (FSDP2 /
replicate / activation checkpointing), and only then calls `MetaInit` on what it kept: `to_empty`
allocates this rank's tensors (an FSDP2 parameter: its own rows), and each module that owns tensors
directly is initialized under a seed hashed from (train.seed, its name in the unsplit model). So the
initial values do not depend on the layout or the world size: pp=2, dp=2 and dp=1 start from the same
bits (on one device type: CPU and CUDA generators differ).

A sharded parameter is initialized whole, one module at a time, and keeps its own rows: a rank holds at
most one module's full tensors beyond its share, and the rows equal those a dp=1 run would draw.
With a `source` (weights to start from, e.g. Hugging Face safetensors), a module whose tensors it holds is
read from it instead, each rank reading only its own rows; the rest (non-persistent buffers) is initialized.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from copy import deepcopy
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["MetaInit", "TensorSource", "module_names", "init_problem"]

_SLOTS = ("_parameters", "_buffers")


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    """Each module's name in the unsplit model: the seed's key, whatever wrappers and stage cuts come later."""
    return {module: name for name, module in model.named_modules()}


def init_problem(model: nn.Module, init_weights: Callable | None) -> str:
    """Why `model` cannot be initialized module by module ("" when it can): a module owns tensors directly
    and has no `reset_parameters` to set them, and no `init_weights` is given."""
    if init_weights is not None:
        return ""
    for name, module in model.named_modules():
        owned = [key for key, t in _direct(module) if t is not None]
        if owned and not hasattr(module, "reset_parameters"):
            return (f"{name} ({type(module).__name__}) owns {', '.join(owned)} directly and has no reset_parameters, "
                    f"and the spec gives no init_weights")
    return ""


class TensorSource(Protocol):
    def fill(self, module: nn.Module) -> bool:
        """Set this rank's part of every tensor `module` owns directly (allocated already); False: it holds
        none of them, and nothing was set."""


@dataclass(frozen=True)
class MetaInit:
    """Materializes a meta module on a device with values that depend only on (seed, module name), or on what
    `source` holds under that module."""

    seed: int
    names: dict[nn.Module, str]
    init_weights: Callable[[nn.Module], None] | None = None
    source: TensorSource | None = None

    @torch.no_grad()
    def __call__(self, model: nn.Module, device: torch.device) -> None:
        model.to_empty(device=device)
        # to_empty leaves whatever bytes the allocator had, non-persistent buffers included: NaN makes a
        # tensor that no init sets fail below, instead of training from garbage.
        for t in _floating(model):
            t.fill_(float("nan"))
        for module in model.modules():
            if module in self.names and any(t is not None for _, t in _direct(module)):
                if self.source is None or not self.source.fill(module):
                    self._init(module, device)
        _check_all_set(model, self.names)

    def real_copy(self, module: nn.Module, device: torch.device) -> nn.Module:
        """A materialized copy of a meta `module`, seeded by names inside it: for measuring (the planner's
        profile, one block at a time), never for training."""
        copy = deepcopy(module)   # on meta: no storage copied
        MetaInit(self.seed, module_names(copy), self.init_weights)(copy, device)
        return copy

    def _init(self, module: nn.Module, device: torch.device) -> None:
        # fork_rng: the training RNG (dropout) stays where it was
        with _whole(module), torch.random.fork_rng(devices=_cuda_index(device)):
            torch.manual_seed(_name_seed(self.seed, self.names[module]))
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            if self.init_weights is not None:
                self.init_weights(module)


def _cuda_index(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [torch.cuda.current_device() if device.index is None else device.index]


def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (seed, name): Python's hash() changes between processes."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def _direct(module: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
    for slot in _SLOTS:
        yield from getattr(module, slot).items()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _floating(model: nn.Module) -> Iterator[torch.Tensor]:
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            yield _local(t)


@contextlib.contextmanager
def _whole(module: nn.Module) -> Iterator[None]:
    """Give `module` full-size plain tensors in place of its sharded ones while its init runs, then copy each
    rank's rows into the shards (no communication: every rank draws the same whole tensor)."""
    swapped = []
    for slot in _SLOTS:
        tensors = getattr(module, slot)
        for key, t in list(tensors.items()):
            if isinstance(t, DTensor):
                whole = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
                tensors[key] = nn.Parameter(whole, t.requires_grad) if slot == "_parameters" else whole
                swapped.append((tensors, key, t))
    try:
        yield
    finally:
        for tensors, key, sharded in swapped:
            sharded.to_local().copy_(_own_rows(tensors[key].detach(), sharded))
            tensors[key] = sharded


def _own_rows(whole: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's part of `whole` as a view (distribute_tensor would copy it): torch.chunk along each Shard
    placement, the split DTensor and FSDP2 use; Replicate keeps it all."""
    mesh = sharded.device_mesh
    for axis, placement in enumerate(sharded.placements):
        assert isinstance(placement, (Shard, Replicate)), f"{placement} is not a placement FSDP2 or replicate uses"
        if isinstance(placement, Shard):
            chunks = torch.chunk(whole, mesh.size(axis), dim=placement.dim)
            coord = mesh.get_local_rank(axis)
            whole = chunks[coord] if coord < len(chunks) else whole.narrow(placement.dim, 0, 0)
    return whole


def _check_all_set(model: nn.Module, names: dict[nn.Module, str]) -> None:
    for module in model.modules():
        for key, t in _direct(module):
            if t is not None and t.is_floating_point() and bool(_local(t).isnan().any()):
                raise ValueError(f"{names.get(module, type(module).__name__)}.{key} was not set by reset_parameters "
                                 f"or the spec's init_weights after allocation (a non-persistent buffer must be "
                                 f"recomputed there). Fix: set it in the spec's init_weights(module).")
