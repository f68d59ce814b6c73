"""Your own model in one file, trained by raydl through its import path: a small MLP classifier.

    raydl train --set model.name=examples.mlp_classifier:spec --set model.options.hidden=256 \\
                --set train.max_steps=200 --set scaling.max_workers=2 --set scaling.min_workers=2
    raydl train --set model.name=examples.mlp_classifier:spec --set parallel.pp_degree=2   # a 2-stage pipeline

Run from the directory that holds examples/ (raydl imports `model.name` from the working
directory, and so do its workers). It reads the built-in image dataset (32x32 RGB shapes,
generated on first use, the `images` task); any dataset from `raydl data prepare --from images`
works too. The model is a plain nn.Module: `blocks` names the children that forward applies in
order, which is all raydl needs to cut it into pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import raydl


@dataclass(kw_only=True)
class MLPOptions:   # --set model.options.hidden=256: checked and converted like raydl's own config
    hidden: int = field(default=128, metadata={"help": "Width of the hidden layers."})
    depth: int = field(default=2, metadata={"help": "Hidden layers after the input layer."})


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, depth: int, classes: int):
        super().__init__()
        self.inp = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU())
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(depth)))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))   # (B, classes)


def build(options: MLPOptions, meta: dict[str, Any]) -> MLP:
    channels, height, width = meta["image_shape"]
    return MLP(channels * height * width, options.hidden, options.depth, meta["num_classes"])


def inputs_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["image"].float() / 255.0, batch["label"].long()   # uint8 (B, C, H, W) pixels -> [0, 1]


def correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    return int((logits.argmax(-1) == labels).sum()), labels.numel()


spec = raydl.ModelSpec(
    name="mlp_classifier", build=build, inputs_targets=inputs_targets, loss=F.cross_entropy,
    example_inputs=lambda meta, micro_batch: torch.rand(micro_batch, *meta["image_shape"]),
    correct=correct, options=MLPOptions, blocks=("inp", "body", "out"), task="images", columns=("image", "label"))
