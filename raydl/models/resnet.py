"""CIFAR-style ResNet (He et al. 2016, 3x3 stem, no max-pool) as blocks: stem, b0..bN, head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raydl.models.blocks import BlockModel

# name: (widths per stage, residual blocks per stage)
SIZES = {
    "tiny": ((16, 32, 64), 1),
    "resnet18": ((64, 128, 256, 512), 2),
}


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


def build_resnet(size: str, *, num_classes: int, channels: int = 3) -> BlockModel:
    widths, per_stage = SIZES[size]
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
