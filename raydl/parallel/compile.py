"""torch.compile per block, as a function applied to a model (torchtitan's `apply_compile`).

    raydl train --set train.compile=true          # compile on CPU workers too (off there under auto)
    torchrun --nproc-per-node 1 -m raydl.worker --set train.compile=auto

Each repeated block (the transformer blocks, Hugging Face decoder layers, residual blocks) gets a compiled
forward of its own; blocks of one class and shape share one compiled graph, so a 12-block model costs the
compilation of one block. It is applied after activation checkpointing (the checkpointed region is what
compiles) and before data parallelism and the pipeline split, the order of torchtitan's `parallelize_llama`:
FSDP2's and DDP's hooks then run eagerly around the compiled regions, and a pipeline stage holds the very block
modules, so each stage runs compiled blocks. The forward is compiled rather than the module
(`torch.compile(block)` would insert `_orig_mod.` into every parameter name) so that checkpoints keep their
names in every layout.

Shapes are static (`dynamic=False`): a new per-rank micro-batch shape (an elastic resize whose batch split is
inexact, the last short eval batch) compiles once more instead of turning every shape symbolic.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch
from torch import nn

from raydl.errors import ConfigError

__all__ = ["CompileChoice", "CompileStats", "apply_compile", "choose_compile", "compiler_missing", "repeated_blocks"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileChoice:
    enabled: bool
    why: str                      # one line for the log
    fallback: bool = False        # auto: a block that fails to compile runs eager instead of failing the run
    unavailable: bool = False     # auto where this machine cannot compile: eager, and the user is told why


def compiler_missing(device_type: str) -> str | None:
    """Why Inductor cannot compile for `device_type` here, or None when it can."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is missing or does not support this GPU (pip install triton)"
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:   # torch raises its own InvalidCxxCompiler (or RuntimeError) when no compiler is found
        return "Inductor's C++ backend finds no C++ compiler (install g++, or set CXX)"
    return None


def choose_compile(setting: str, device_type: str) -> CompileChoice:
    """The policy of train.compile (auto | true | false) on a `device_type` worker; refuses `true` where this
    machine cannot compile."""
    if setting == "false":
        return CompileChoice(False, "train.compile=false: eager")
    if setting == "auto" and device_type != "cuda":
        return CompileChoice(False, "train.compile=auto: eager on CPU workers")
    missing = compiler_missing(device_type)
    if missing and setting == "true":
        raise ConfigError("train.compile", f"is true, but this {device_type} worker cannot compile: {missing}",
                          "install what is missing, or --set train.compile=auto to train eager where compiling "
                          "is not possible")
    if missing:
        return CompileChoice(False, f"train.compile=auto: training eager, since {missing}", unavailable=True)
    return CompileChoice(True, f"train.compile={setting}: compiling each repeated block", fallback=setting == "auto")


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks whose class occurs more than once (seen through activation checkpointing's wrapper):
    the ones a per-block compilation serves many times; embeddings and heads stay eager."""
    kinds = {name: type(getattr(block, "_checkpoint_wrapped_module", block)) for name, block in model.blocks.items()}
    count = collections.Counter(kinds.values())
    return [name for name, kind in kinds.items() if count[kind] > 1]


def apply_compile(model: nn.Module, *, fallback: bool = False) -> list[str]:
    """Compile the forward of each repeated block of `model` (a BlockModel) in place; returns their names.
    `fallback`: a block Dynamo or Inductor cannot compile runs eager, with torch's warning (train.compile=auto)."""
    import torch._dynamo

    if fallback:
        torch._dynamo.config.suppress_errors = True
    names = repeated_blocks(model)
    for name in names:
        block = model.blocks[name]
        block.forward = torch.compile(block.forward, dynamic=False)
    return names


class CompileStats:
    """Compilation seconds and recompiles of this process since it was made (Dynamo's counters are per process):
    a recompile is a graph compiled after the first step (a new shape, eval's no-grad mode)."""

    def __init__(self) -> None:
        self.graphs_at_start, self.seconds_at_start = _graphs(), _seconds()
        self.graphs_after_first_step: int | None = None

    @property
    def first_step_pending(self) -> bool:
        return self.graphs_after_first_step is None

    def first_step_done(self) -> None:
        self.graphs_after_first_step = _graphs()

    def to_dict(self) -> dict[str, float | int]:
        first = self.graphs_at_start if self.graphs_after_first_step is None else self.graphs_after_first_step
        return {"seconds": round(_seconds() - self.seconds_at_start, 3), "recompiles": _graphs() - first,
                "graphs": _graphs() - self.graphs_at_start}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _seconds() -> float:
    """Dynamo's and AOTAutograd's compile time so far (forward graphs and their backward), seconds."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)
