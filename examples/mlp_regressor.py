"""Your own model on your own table: an MLP regressing `target` from the fixed-size float list `features`.

    python examples/make_table.py data/raw/table.parquet
    raydl data prepare --from parquet data/raw/table.parquet --out data/table
    raydl train --set model.name=examples.mlp_regressor:spec --set data.path=data/table \\
                --set train.max_steps=200

Run from the directory that holds examples/. The spec names no task (any parquet table will do)
and declares the columns it reads; raydl checks before Ray starts that the dataset has them as
numbers. The model's input width comes from the dataset's manifest: `meta["columns"]` lists
each numeric column's dtype and per-row shape ([] a scalar, [n] a fixed-size list, [-1] a
variable-length list, which reaches the batch padded with a `<column>_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import raydl


@dataclass(kw_only=True)
class RegressorOptions:   # --set model.options.hidden=128
    hidden: int = field(default=64, metadata={"help": "Width of the hidden layers."})
    depth: int = field(default=2, metadata={"help": "Hidden layers after the input layer."})


class MLPRegressor(nn.Module):
    def __init__(self, in_features: int, hidden: int, depth: int):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(depth)))
        self.out = nn.Sequential(nn.Linear(hidden, 1), nn.Flatten(0))   # (B, 1) -> (B,), like the targets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))


def num_features(meta: dict[str, Any]) -> int:
    return meta["columns"]["features"]["shape"][0]


def build(options: RegressorOptions, meta: dict[str, Any]) -> MLPRegressor:
    return MLPRegressor(num_features(meta), options.hidden, options.depth)


def inputs_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["features"].float(), batch["target"].float()


spec = raydl.ModelSpec(
    name="mlp_regressor", build=build, inputs_targets=inputs_targets, loss=F.mse_loss,
    example_inputs=lambda meta, micro_batch: torch.randn(micro_batch, num_features(meta)),
    options=RegressorOptions, blocks=("inp", "body", "out"), columns=("features", "target"))
