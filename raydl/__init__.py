"""raydl: elastic data- and pipeline-parallel PyTorch training on Ray.

    import raydl
    summary = raydl.train("my.yaml", overrides=["train.max_steps=100"], model=my_spec)

The public surface: `train`, `sweep` (raydl.api), `ModelSpec` (the model contract),
`BlockModel`, and the errors they raise for bad input. Importing raydl loads neither torch
nor Ray: the names that need them load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from raydl.errors import CheckpointError, ConfigError, DataError, LayoutError, RaydlError

_LAZY = {"ModelSpec": "raydl.models.spec", "BlockModel": "raydl.models.blocks",
         "train": "raydl.api", "sweep": "raydl.api"}

__all__ = ["train", "sweep", "ModelSpec", "BlockModel",
           "RaydlError", "ConfigError", "DataError", "CheckpointError", "LayoutError"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'raydl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
