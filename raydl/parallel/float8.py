"""train.precision=fp8: float8 matmuls through torchao, applied to a model as torchtitan's float8 converter does.

`apply_float8` swaps the `nn.Linear` layers of the repeated blocks for torchao's `Float8Linear` (dynamic scales,
per tensor or per row), before activation checkpointing, compile and data parallelism wrap them. Left in bf16: the
first and last blocks (embeddings, the output head and its norm, which the loss reads), norms (not Linear), and
the layers torchao's size filter for the recipe finds too small to gain (its thresholds were measured on H100s).
"""

from __future__ import annotations

import torch
from torch import nn

from raydl.errors import ConfigError
from raydl.models.blocks import BlockModel

# float8 tensor cores: Ada (8.9) and Hopper (9.0) and later.
MIN_CAPABILITY = (8, 9)


def fp8_refusal(reason: str) -> ConfigError:
    return ConfigError("train.precision", f"is 'fp8', but {reason}",
                       "use --set train.precision=bf16 (with train.compile on, the nearest in speed), or run on GPUs "
                       "of compute capability 8.9 or more (H100, H200, L4, RTX 40xx)")


def check_device(device: torch.device) -> None:
    """Refuse a device without float8 matmuls."""
    if device.type != "cuda":
        raise fp8_refusal(f"the workers compute on {device.type.upper()}, and float8 matmuls need an NVIDIA GPU of "
                          f"compute capability 8.9 or more")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise fp8_refusal(f"the workers' GPU ({torch.cuda.get_device_name(device)}) has compute capability "
                          f"{capability[0]}.{capability[1]}, and float8 matmuls need 8.9 or more")


def check_before_start(precision: str, *, workers_on_gpu: bool | None, local: bool) -> None:
    """On the driver, before any worker starts: refuse fp8 where the workers' devices are known to lack it.
    `workers_on_gpu`: False for CPU workers (scaling.use_gpu=false, or a cluster without GPUs), None while unknown.
    `local`: the workers run on this machine (a private Ray), whose GPU is checked here; on a cluster the workers
    check their own GPU as they start."""
    if precision != "fp8":
        return
    if workers_on_gpu is False:
        raise fp8_refusal("the workers compute on CPU (scaling.use_gpu=false, or the cluster has no GPU), and "
                          "float8 matmuls need an NVIDIA GPU of compute capability 8.9 or more")
    if local:
        check_device(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


def high_precision_blocks(model: BlockModel) -> list[str]:
    """The blocks kept out of float8: the first and the last (embeddings, the head) when there are blocks between."""
    names = model.block_names
    return [names[0], names[-1]] if len(names) > 2 else []


def apply_float8(model: BlockModel, *, scaling: str) -> int:
    """Swap the Linear layers fp8 can take for float8 ones (in place, also on meta); returns how many. Refuses a
    model with none: fp8 would change nothing."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe
    except ImportError as e:
        raise fp8_refusal(f"torchao cannot be imported here ({e}): install it with `pip install -e \".[fp8]\"`") from e
    # Names as torchao's filter sees them: "blocks.<name>." prefixes each kept-out block's layers.
    kept_out = [f"blocks.{name}." for name in high_precision_blocks(model)]
    size_filter = _auto_filter_for_recipe(scaling, filter_fqns=kept_out)
    converted: list[str] = []

    def takes_fp8(module: nn.Module, fqn: str) -> bool:
        if size_filter(module, fqn + "."):   # the trailing dot: "blocks.h1." must not match "blocks.h10.x"
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(scaling), module_filter_fn=takes_fp8)
    if not converted:
        raise fp8_refusal("no Linear layer of this model can take it: float8 needs both dimensions divisible by 16, "
                          f"and torchao's {scaling} size filter keeps smaller layers in bf16, where they are faster "
                          "(the first and last blocks stay high precision too)")
    return len(converted)
