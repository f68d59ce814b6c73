"""Model registry: the trainer only ever talks to a model through its `ModelSpec`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from raydl.config import ModelSection
from raydl.errors import ConfigError
from raydl.models import gpt, resnet
from raydl.models.blocks import BlockModel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    sizes: tuple[str, ...]
    task: str                                   # the dataset kind it trains on: "tokens" or "images"
    build: Callable[[ModelSection, dict[str, Any]], BlockModel]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    correct: Callable[[torch.Tensor, torch.Tensor], tuple[int, int]]
    inputs_targets: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
    units_per_sample: Callable[[dict[str, Any]], int]   # tokens per sample (or 1 image), for throughput
    flops_per_sample: Callable[[ModelSection, dict[str, Any]], float]   # training FLOPs, for MFU; 0 = unknown
    example_inputs: Callable[[dict[str, Any], int], torch.Tensor]   # (meta, micro_batch) -> a random model input


def _tokens(batch):
    return batch["input_ids"].long(), batch["labels"].long()


def _images(batch):
    # uint8 HWC-flattened rows -> normalised float NCHW; the shape comes from the dataset manifest.
    x = batch["image"].float().div_(255.0).sub_(0.5).div_(0.25)
    return x, batch["label"].long()


def _random_tokens(meta: dict[str, Any], micro_batch: int) -> torch.Tensor:
    return torch.randint(meta["vocab_size"], (micro_batch, meta["seq_len"]))


def _random_images(meta: dict[str, Any], micro_batch: int) -> torch.Tensor:
    return torch.randn(micro_batch, *meta["image_shape"])   # as normalised by _images


def _build_gpt(m: ModelSection, meta: dict[str, Any]) -> BlockModel:
    return gpt.build_gpt(m.size, vocab_size=meta["vocab_size"], seq_len=meta["seq_len"], dropout=m.dropout)


def _build_resnet(m: ModelSection, meta: dict[str, Any]) -> BlockModel:
    return resnet.build_resnet(m.size, num_classes=meta["num_classes"], channels=meta["image_shape"][0])


REGISTRY: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", tuple(gpt.SIZES), "tokens", _build_gpt, gpt.gpt_loss, gpt.gpt_correct, _tokens,
                     lambda meta: meta["seq_len"],
                     lambda m, meta: meta["seq_len"] * gpt.gpt_flops_per_token(m.size, vocab_size=meta["vocab_size"],
                                                                               seq_len=meta["seq_len"]),
                     _random_tokens),
    "resnet": ModelSpec("resnet", tuple(resnet.SIZES), "images", _build_resnet, resnet.resnet_loss,
                        resnet.resnet_correct, _images, lambda meta: 1, lambda m, meta: 0.0, _random_images),
}


def get_spec(model: ModelSection) -> ModelSpec:
    spec = REGISTRY[model.name]
    if model.size not in spec.sizes:
        raise ConfigError("model.size", f"is {model.size!r}, which model '{model.name}' does not have",
                          f"use one of {', '.join(spec.sizes)}")
    return spec
