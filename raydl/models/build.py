"""A spec's module -> the `BlockModel` every engine, planner and checkpoint works on.

- A `BlockModel` is used as it is.
- A plain module with `ModelSpec.blocks` becomes a BlockModel of those children. Whether applying
  them in order equals the module's `forward` is checked once on `example_inputs` (not on the
  meta device, which has no values): the first block whose output differs is named.
- A plain module without `blocks` becomes one block, "model": every data-parallel wrapper works
  on it, but a pipeline has nothing to cut, so pp > 1 and pp = auto are a LayoutError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from raydl.errors import ConfigError, LayoutError
from raydl.models.blocks import BlockModel
from raydl.models.spec import ModelSpec

__all__ = ["SkipWeightInit", "build_model", "check_blocks"]

WHOLE = "model"   # the one block of a plain module without `blocks`
BLOCKS_FIX = ("list in ModelSpec.blocks the top-level children that forward applies, in its order and with nothing "
              "between them, or build a raydl.BlockModel")


def build_model(spec: ModelSpec, options: Any, meta: dict[str, Any], *, pp_degree: int | str) -> BlockModel:
    module = spec.build(options, meta)
    if not isinstance(module, nn.Module):
        raise ConfigError("model.name", f"names model '{spec.name}', whose build returned a "
                          f"{type(module).__name__}, not a torch.nn.Module", "return the model from build")
    if isinstance(module, BlockModel):
        return module
    if spec.blocks is None:
        if pp_degree != 1:
            raise LayoutError(f"parallel.pp_degree is {pp_degree}, but model '{spec.name}' is a plain "
                              f"{type(module).__name__} without ModelSpec.blocks, so it has no pipeline stages to "
                              f"cut. Fix: use parallel.pp_degree=1 (every data-parallel wrapper works), or give the "
                              f"spec blocks=(...) naming the top-level children that forward applies in order, or "
                              f"build a raydl.BlockModel.")
        return BlockModel({WHOLE: module})
    blocks = _named_blocks(module, spec)
    if not _on_meta(module):
        check_blocks(module, blocks, spec, meta)
    return BlockModel(blocks)


class SkipWeightInit(TorchFunctionMode):
    """Weight init does nothing to meta tensors, yet torch's meta normal_ imports torch._dynamo first: a second or
    more of every run's start (raydl bench startup). Used around every build on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init" or func is torch.Tensor.normal_:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _named_blocks(module: nn.Module, spec: ModelSpec) -> dict[str, nn.Module]:
    children = dict(module.named_children())
    missing = [name for name in spec.blocks if name not in children]
    if missing or not spec.blocks or len(set(spec.blocks)) != len(spec.blocks):
        problem = (f"names {missing[0]!r}, which is not a top-level child" if missing
                   else "is empty" if not spec.blocks else "names a child twice")
        raise ConfigError("model.name", f"names model '{spec.name}', whose ModelSpec.blocks {list(spec.blocks)} "
                          f"{problem} of its {type(module).__name__} (children: {', '.join(children) or 'none'})",
                          BLOCKS_FIX)
    return {name: children[name] for name in spec.blocks}


@torch.no_grad()
def check_blocks(module: nn.Module, blocks: dict[str, nn.Module], spec: ModelSpec, meta: dict[str, Any]) -> None:
    """Apply the blocks in order and compare each output with the same block's output inside forward."""
    was_training = module.training
    module.eval()   # no dropout; batch norm uses (and keeps) its running statistics
    try:
        with _outputs_inside(blocks) as inside, torch.random.fork_rng(devices=[]):
            x = spec.example_inputs(meta, 2)
            expected = module(x)
        y = x
        for name, block in blocks.items():
            y = block(y)
            _check_one(spec, name, y, inside[name])
        if not _same(y, expected):
            _refuse(spec, f"the output of the last block, {list(blocks)[-1]!r}, differs from forward's: forward "
                          "does more after it")
    finally:
        module.train(was_training)


@contextlib.contextmanager
def _outputs_inside(blocks: dict[str, nn.Module]) -> Iterator[dict[str, list[Any]]]:
    """What each block returns while the hooks are on (one entry per call)."""
    inside: dict[str, list[Any]] = {name: [] for name in blocks}
    hooks = [block.register_forward_hook(lambda _m, _i, out, name=name: inside[name].append(out))
             for name, block in blocks.items()]
    try:
        yield inside
    finally:
        for hook in hooks:
            hook.remove()


def _check_one(spec: ModelSpec, name: str, out: Any, seen: list[Any]) -> None:
    if not isinstance(out, torch.Tensor):
        _refuse(spec, f"block {name!r} returns a {type(out).__name__}; a block must return one tensor, the next "
                      "block's input")
    if len(seen) != 1:
        _refuse(spec, f"forward calls block {name!r} {len(seen)} times; each block must run once")
    if not _same(out, seen[0]):
        _refuse(spec, f"block {name!r} is the first whose output differs from its output inside forward: forward "
                      "does something before it that the blocks do not")


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5))


def _refuse(spec: ModelSpec, problem: str) -> None:
    raise ConfigError("model.name", f"names model '{spec.name}', whose ModelSpec.blocks {list(spec.blocks)} do not "
                      f"reproduce its forward on example_inputs: {problem}", BLOCKS_FIX)
