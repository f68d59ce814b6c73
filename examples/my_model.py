import torch
import torch.nn.functional as F
from torch import nn

import raydl


def build(options, meta):   # meta: what the dataset holds (here 3x32x32 images of 4 shapes)
    c, h, w = meta["image_shape"]
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 128), nn.ReLU(), nn.Linear(128, meta["num_classes"]))


spec = raydl.ModelSpec(name="my_model", build=build, loss=F.cross_entropy, task="images", columns=("image", "label"),
                       inputs_targets=lambda batch: (batch["image"].float() / 255, batch["label"].long()),
                       example_inputs=lambda meta, n: torch.rand(n, *meta["image_shape"]))
