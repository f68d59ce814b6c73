"""CIFAR-style ResNet (He et al. 2016, 3x3 stem, no max-pool) as blocks: stem, b0..bN, head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raydl.models.blocks import BlockModel
from raydl.models.presets import ResnetOptions
from raydl.models.spec import ModelSpec


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class Stem(nn.Module):
    def __init__(self, channels: int, width: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class Head(nn.Module):
    def __init__(self, width: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_resnet(widths: tuple[int, ...], per_stage: int, *, num_classes: int, channels: int) -> BlockModel:
    blocks: dict[str, nn.Module] = {"stem": Stem(channels, widths[0])}
    c_in, i = widths[0], 0
    for stage, width in enumerate(widths):
        for j in range(per_stage):
            blocks[f"b{i}"] = BasicBlock(c_in, width, stride=2 if stage > 0 and j == 0 else 1)
            c_in, i = width, i + 1
    blocks["head"] = Head(c_in, num_classes)
    return BlockModel(blocks)


def resnet_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def resnet_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    return int((logits.argmax(-1) == labels).sum()), labels.numel()


def images(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # uint8 HWC-flattened rows -> normalised float NCHW; the shape comes from the dataset manifest.
    x = batch["image"].float().div_(255.0).sub_(0.5).div_(0.25)
    return x, batch["label"].long()


def random_images(meta: dict[str, Any], micro_batch: int) -> torch.Tensor:
    return torch.randn(micro_batch, *meta["image_shape"])   # as normalised by images()


def build(options: ResnetOptions, meta: dict[str, Any]) -> BlockModel:
    return build_resnet(*options.dims(), num_classes=meta["num_classes"], channels=meta["image_shape"][0])


spec = ModelSpec(name="resnet", build=build, inputs_targets=images, loss=resnet_loss, example_inputs=random_images,
                 correct=resnet_correct, options=ResnetOptions, task="images", columns=("image", "label"))
