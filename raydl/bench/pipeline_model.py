"""The model of `raydl bench pipeline` and what it measures in it: blocks whose compute is real or
simulated by sleeps (counted by a Clock), and the bytes autograd saves for backward (SavedBytes)."""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from raydl.models.blocks import BlockModel

PP = 2
NUM_BLOCKS = 4


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward, for a saved_tensors_hooks context.

    A tensor saved twice (same data pointer and size) counts once; parameters (`exclude`) do not count.
    Each packed tensor is wrapped in a handle whose release (autograd frees saved tensors after the
    backward that used them) subtracts its bytes again.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._skip = {t.data_ptr() for t in exclude}
        self._refs: dict[tuple[int, int], int] = {}
        self.current = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.data_ptr() in self._skip:
            return tensor
        return _Saved(self, tensor, (tensor.data_ptr(), tensor.numel() * tensor.element_size()))

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _add(self, key: tuple[int, int]) -> None:
        self._refs[key] = self._refs.get(key, 0) + 1
        if self._refs[key] == 1:
            self.current += key[1]
            self.peak = max(self.peak, self.current)

    def _remove(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.current -= key[1]


class _Saved:
    __slots__ = ("tensor", "_owner", "_key")

    def __init__(self, owner: SavedBytes, tensor: torch.Tensor, key: tuple[int, int]):
        self.tensor, self._owner, self._key = tensor, owner, key
        owner._add(key)

    def __del__(self):
        self._owner._remove(self._key)


class Clock:
    """Seconds spent in simulated compute and the number of passes, by kind (F, B, W)."""

    def __init__(self):
        self.busy_s = 0.0
        self.counts = {"F": 0, "B": 0, "W": 0}

    def spend(self, kind: str, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.busy_s += time.perf_counter() - t0   # the oversleep is the simulated compute's, not the bubble's
        self.counts[kind] += 1


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: simulated backward work on the graph path it sits on."""

    @staticmethod
    def forward(ctx, x, clock: Clock, kind: str, seconds: float):
        ctx.clock, ctx.kind, ctx.seconds = clock, kind, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.spend(ctx.kind, ctx.seconds)
        return grad, None, None, None


class Block(nn.Module):
    """Linear + GELU. With a clock, each pass also sleeps `cost_s`: F in forward, B on the activation path
    (runs in a zero-bubble I step), W on the weight path (runs in its W step)."""

    def __init__(self, dim: int, clock: Clock | None = None, cost_s: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.clock, self.cost_s = clock, cost_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is None:
            return F.gelu(self.fc(x))
        self.clock.spend("F", self.cost_s)
        weight = _SleepInBackward.apply(self.fc.weight, self.clock, "W", self.cost_s)
        h = _SleepInBackward.apply(F.linear(x, weight, self.fc.bias), self.clock, "B", self.cost_s)
        return F.gelu(h)


def linear_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Saves nothing for backward (sub and mean need no inputs), so the memory measured is the blocks'.
    return (out - target).mean()


def build_model(dim: int, clock: Clock | None, cost_s: float) -> BlockModel:
    torch.manual_seed(0)
    return BlockModel({f"b{i}": Block(dim, clock, cost_s) for i in range(NUM_BLOCKS)})


def saved_bytes(module: nn.Module, chunk: torch.Tensor) -> int:
    """Bytes one micro-batch through `module` saves for backward."""
    tracker = SavedBytes(exclude=module.parameters())
    with tracker.hooks():
        module(chunk.detach())   # the output is dropped at once: its graph and saved tensors go with it
    return tracker.peak
