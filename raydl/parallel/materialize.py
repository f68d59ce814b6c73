"""Allocate and initialize only the tensors a rank owns, after its layout is applied (torchtitan's order).

A worker builds its model on `meta` (no storage), cuts its pipeline stage and wraps it (FSDP2 /
replicate / activation checkpointing), and only then calls `MetaInit` on what it kept: `to_empty`
allocates this rank's tensors (an FSDP2 parameter: its own rows), and each module that owns tensors
directly is initialized under a seed hashed from (train.seed, its name in the unsplit model). So the
initial values do not depend on the layout or the world size: pp=2, dp=2 and dp=1 start from the same
bits (on one device type: CPU and CUDA generators differ).

A sharded parameter is initialized whole, one module at a time, and keeps its own rows: a rank holds at
most one module's full tensors beyond its share, and the rows equal those a dp=1 run would draw. A spec whose
init draws each row alone (`ModelSpec.init_by_rows`, raydl's gpt) is initialized in blocks of ROWS_PER_DRAW rows
instead, each under a seed of its own, on every layout: a rank draws only the blocks that hold its rows (about
its share instead of the whole model: the normal draws of a 1B model take ~13 s of one core here).
With a `source` (weights to start from, e.g. Hugging Face safetensors), a module whose tensors it holds is
read from it instead, each rank reading only its own rows; the rest (non-persistent buffers) is initialized.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from copy import deepcopy
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["MetaInit", "TensorSource", "module_names", "init_problem"]

_SLOTS = ("_parameters", "_buffers")
ROWS_PER_DRAW = 128   # part of the initial values: changing it changes every by-rows model's first weights


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
    by_rows: bool = False   # ModelSpec.init_by_rows

    @torch.no_grad()
    def __call__(self, model: nn.Module, device: torch.device) -> None:
        model.to_empty(device=device)
        # to_empty leaves whatever bytes the allocator had, non-persistent buffers included: NaN makes a
        # tensor that no init sets fail below, instead of training from garbage.
        for t in _floating(model):
            t.fill_(float("nan"))
        # fork_rng once, not per draw: the training RNG (dropout) stays where it was, and on a GPU each fork
        # saves and restores the device's RNG state (a 1B gpt's ~4,000 row blocks took 2 s that way).
        with torch.random.fork_rng(devices=_cuda_index(device)):
            for module in model.modules():
                if module in self.names and any(t is not None for _, t in _direct(module)):
                    if self.source is None or not self.source.fill(module):
                        self._init(module)
        for module in model.modules():   # to_empty gave each module of a tied pair a tensor of its own
            if hasattr(module, "retie"):
                module.retie(model)
        _check_all_set(model, self.names)

    def real_copy(self, module: nn.Module, device: torch.device) -> nn.Module:
        """A materialized copy of a meta `module`, seeded by names inside it: for measuring (the planner's
        profile, one block at a time), never for training."""
        copy = deepcopy(module)   # on meta: no storage copied
        MetaInit(self.seed, module_names(copy), self.init_weights, by_rows=self.by_rows)(copy, device)
        return copy

    def _init(self, module: nn.Module) -> None:
        owned = _owned_rows(module) if self.by_rows else None
        if owned is None:
            with _whole(module):
                self._draw(module, self.names[module])
            return
        spans = [(a, b) for _, _, _, (a, b) in owned if a < b]
        if not spans:   # more ranks than rows: this one holds none
            return
        first, end = min(a for a, _ in spans), max(b for _, b in spans)
        for block in range(first // ROWS_PER_DRAW, math.ceil(end / ROWS_PER_DRAW)):
            start, stop = block * ROWS_PER_DRAW, min((block + 1) * ROWS_PER_DRAW, owned[0][2].shape[0])
            if any(a < stop and start < b for a, b in spans):
                with _rows(module, owned, start, stop):
                    self._draw(module, f"{self.names[module]}#rows{block}")

    def _draw(self, module: nn.Module, name: str) -> None:
        torch.manual_seed(_name_seed(self.seed, name))
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


def _owned_rows(module: nn.Module) -> list[tuple[dict, str, torch.Tensor, tuple[int, int]]] | None:
    """(its slot's dict, key, tensor, (first row, end)) of this rank's rows of each tensor `module` owns directly, or None
    when they cannot be drawn by rows: a scalar, tensors whose row counts differ, or a split along another dim."""
    owned, counts = [], set()
    for slot in _SLOTS:
        tensors = getattr(module, slot)
        for key, t in tensors.items():
            if t is None:
                continue
            if t.dim() == 0:
                return None
            span = _row_span(t)
            if span is None:
                return None
            owned.append((tensors, key, t, span))
            counts.add(t.shape[0])
    return owned if len(counts) == 1 else None


def _row_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows of `t` this rank holds (those `_own_rows` keeps), or None for a split along another dim."""
    start, length = 0, t.shape[0]
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        for axis, placement in enumerate(t.placements):
            if isinstance(placement, Shard):
                if placement.dim != 0:
                    return None
                offset, length = _chunk(length, mesh.size(axis), mesh.get_local_rank(axis))
                start += offset
            elif not isinstance(placement, Replicate):
                return None
    return start, start + length


@contextlib.contextmanager
def _rows(module: nn.Module, owned: list, start: int, stop: int) -> Iterator[None]:
    """Give `module` plain tensors of rows [start, stop) of its own while its init runs, then copy the rows this
    rank holds into its tensors."""
    for tensors, key, t, _ in owned:
        part = torch.empty((stop - start, *t.shape[1:]), dtype=t.dtype, device=_local(t).device)
        tensors[key] = nn.Parameter(part, t.requires_grad) if tensors is module._parameters else part
    try:
        yield
    finally:
        for tensors, key, t, (a, b) in owned:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                _local(t)[lo - a:hi - a].copy_(tensors[key].detach()[lo - start:hi - start])
            tensors[key] = t


def _own_rows(whole: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's part of `whole` as a view (distribute_tensor would copy it): `_chunk` along each Shard
    placement, torch.chunk's split that DTensor and FSDP2 use; Replicate keeps it all."""
    mesh = sharded.device_mesh
    for axis, placement in enumerate(sharded.placements):
        assert isinstance(placement, (Shard, Replicate)), f"{placement} is not a placement FSDP2 or replicate uses"
        if isinstance(placement, Shard):
            offset, size = _chunk(whole.shape[placement.dim], mesh.size(axis), mesh.get_local_rank(axis))
            whole = whole.narrow(placement.dim, offset, size)
    return whole


def _chunk(length: int, parts: int, coord: int) -> tuple[int, int]:
    """(offset, size) of part `coord` of `length` as torch.chunk splits it: parts of ceil(length / parts), the
    last shorter, and none at all past the end (a rank may hold nothing)."""
    per = math.ceil(length / parts)
    offset = min(coord * per, length)
    return offset, min(per, length - offset)


def _check_all_set(model: nn.Module, names: dict[nn.Module, str]) -> None:
    for module in model.modules():
        for key, t in _direct(module):
            if t is not None and t.is_floating_point() and bool(_local(t).isnan().any()):
                raise ValueError(f"{names.get(module, type(module).__name__)}.{key} was not set by reset_parameters "
                                 f"or the spec's init_weights after allocation (a non-persistent buffer must be "
                                 f"recomputed there). Fix: set it in the spec's init_weights(module).")
