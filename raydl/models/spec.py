"""The public model contract, version 1: how raydl talks to any model.

A `ModelSpec` says how to build the model from its options and the dataset's meta, which
batch columns are its inputs and targets, and its loss. raydl never looks inside the model
beyond that: pipeline stages come from a `BlockModel`'s ordered blocks, or from `blocks`,
the names of a plain module's top-level children whose application in order equals its
`forward` (raydl checks that once on `example_inputs` when it builds the model).

    spec = raydl.ModelSpec(name="mlp", build=lambda options, meta: MLP(meta["num_features"]),
                           inputs_targets=lambda batch: (batch["x"], batch["y"]),
                           loss=torch.nn.functional.mse_loss,
                           example_inputs=lambda meta, n: torch.randn(n, meta["num_features"]))

Name a spec in a config as `model.name: package.module:attribute` (the spec, or a function
that returns one), or hand it to `raydl.train(model=spec)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # `import raydl` stays free of torch
    import torch
    from torch import nn


def _one_unit_per_sample(meta: dict[str, Any]) -> int:
    return 1


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How raydl talks to any model. Version 1 (README states the version and what may change)."""

    name: str
    # (options, dataset meta) -> a BlockModel, or a plain nn.Module (see `blocks`)
    build: Callable[[Any, dict[str, Any]], nn.Module]
    # a batch of column tensors -> (model inputs, targets)
    inputs_targets: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
    # (outputs, targets) -> the mean over its targets (integer targets not -100, or every element of floating-point
    # ones), or (sum over them, their count): a step weighs every target of its global batch alike
    # (raydl.models.loss.loss_terms)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # (meta, micro_batch) -> a random input batch, as inputs_targets would give it
    example_inputs: Callable[[dict[str, Any], int], torch.Tensor]
    # (outputs, targets) -> (correct, counted) for an accuracy metric; None = no accuracy
    correct: Callable[[torch.Tensor, torch.Tensor], tuple[int, int]] | None = None
    # tokens (or 1) per sample, for throughput
    units_per_sample: Callable[[dict[str, Any]], int] = _one_unit_per_sample
    # training FLOPs per sample, for MFU; None = "unknown", never guessed
    flops_per_sample: Callable[[Any, dict[str, Any]], float] | None = None
    # a dataclass of the model's own options: `model.options` is coerced into it strictly
    options: type | None = None
    # plain nn.Module only: top-level child names whose sequential application equals forward
    blocks: tuple[str, ...] | None = None
    # the dataset kind it needs ("tokens", "images"); None = any parquet table
    task: str | None = None
    # dataset columns inputs_targets reads (checked before Ray starts)
    columns: tuple[str, ...] = ()
    # module -> None: sets the tensors a module owns directly, after its reset_parameters (if it has one) ran.
    # Workers build on meta and call it once per module that owns tensors, under a seed hashed from
    # (train.seed, the module's name), so initial weights do not depend on the layout. None = reset_parameters
    # alone; a module owning tensors without reset_parameters then makes the workers build as before, whole.
    init_weights: Callable[[nn.Module], None] | None = None
    # True: reset_parameters and init_weights draw each row of a tensor alone, whatever its number of rows (i.i.d.
    # draws whose scale depends on the other dims only: GPT-2's normal, nn.Linear's fan_in; not fan_out, not a
    # padding row). Workers then draw a tensor in blocks of rows, each under a seed of its own, and a rank only
    # the blocks holding its rows: faster start-up under FSDP2. Changes the initial values (on every layout alike).
    init_by_rows: bool = False
    # a batch -> the keywords the model's forward takes beside its inputs, each a (rows, ...) tensor that splits
    # with them into micro-batches and reaches every pipeline stage (a BlockModel gives them to every block).
    # raydl's token models take a packed batch's `documents` (raydl.models.packing.packed_kwargs). None = none: a
    # packed dataset (raydl data prepare --pack) is then refused before any worker starts.
    forward_kwargs: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def model_kwargs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`forward_kwargs(batch)`, or none."""
        return self.forward_kwargs(batch) if self.forward_kwargs else {}

    def count_correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
        """(correct, counted) of `correct`; (0, 0) without one, which leaves the accuracy unknown."""
        return self.correct(outputs, targets) if self.correct else (0, 0)
