"""A user's model file, as the tests copy it into their own directory (mymodels/net.py) and name it by
import path: a good spec, its variants, and things that are not specs."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import raydl


@dataclasses.dataclass(kw_only=True)
class Options:
    hidden: int = 32


class Net(nn.Module):
    def __init__(self, d_in, hidden, classes):
        super().__init__()
        self.inp = nn.Sequential(nn.Flatten(), nn.Linear(d_in, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(self.inp(x))


def build(options, meta):
    c, h, w = meta["image_shape"]
    return Net(c * h * w, options.hidden, meta["num_classes"])


def pixels(batch):
    return batch["image"].float() / 255.0, batch["label"].long()


def random_pixels(meta, n):
    return torch.rand(n, *meta["image_shape"])


common = {"build": build, "loss": F.cross_entropy, "inputs_targets": pixels, "example_inputs": random_pixels,
          "options": Options}
spec = raydl.ModelSpec(name="own_net", blocks=("inp", "out"), task="images", columns=("image", "label"), **common)
plain = raydl.ModelSpec(name="own_plain", task="images", **common)
wrong_blocks = raydl.ModelSpec(name="own_wrong", blocks=("inp", "head"), task="images", **common)
# both children exist, but forward applies inp first: only a model with values shows it (the driver's check)
swapped_blocks = raydl.ModelSpec(name="own_swapped", blocks=("out", "inp"), task="images", **common)
untasked = raydl.ModelSpec(name="own_untasked", **common)
needs_column = raydl.ModelSpec(name="own_column", task="images", columns=("image", "weight"), **common)
not_a_spec = 42


def make_spec():
    return spec


def broken():
    raise ValueError("no weights here")
