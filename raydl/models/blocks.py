"""Models as an ordered list of blocks, so pipeline stages can be cut between blocks.

`BlockModel.blocks` is an `nn.ModuleDict` in execution order. A pipeline stage is a BlockModel
of the blocks it owns, under their names (torchtitan's approach), so every parameter
keeps its fully qualified name (`blocks.h3.attn.qkv.weight`) in every layout: that is what
lets a checkpoint saved at one layout load at another.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockModel(nn.Module):
    # {parameter: the parameter it is tied to}, names as in the whole model: one weight where both blocks are in
    # one module, two copies kept equal where they are on different pipeline stages (gpt2's head and embedding)
    tied: dict[str, str] = {}

    def __init__(self, blocks: dict[str, nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """`kwargs`: the spec's `forward_kwargs` of the batch (a packed batch's documents), given to every block."""
        for block in self.blocks.values():
            x = block(x, **kwargs)
        return x

    @property
    def block_names(self) -> list[str]:
        return list(self.blocks.keys())

    def keep_blocks(self, names: list[str]) -> "BlockModel":
        """Delete every block not in `names` (in place); the rest keep their names."""
        for name in list(self.blocks.keys()):
            if name not in names:
                del self.blocks[name]
        return self


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
