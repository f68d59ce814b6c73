"""raydl: elastic data- and pipeline-parallel PyTorch training on Ray.

    import raydl
    summary = raydl.train("my.yaml", overrides=["train.max_steps=100"], model=my_spec)

The public surface: `train`, `sweep` (raydl.api), `ModelSpec` (the model contract),
`BlockModel`, and the errors they raise for bad input. Importing raydl loads neither torch
nor Ray: the names that need them load on first use.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from raydl.errors import CheckpointError, ConfigError, DataError, LayoutError, RaydlError

_LAZY = {"ModelSpec": "raydl.models.spec", "BlockModel": "raydl.models.blocks", "sweep": "raydl.api"}

__all__ = ["BlockModel", "CheckpointError", "ConfigError", "DataError", "LayoutError", "ModelSpec", "RaydlError",
           "sweep", "train"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'raydl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


class _CallablePackage(types.ModuleType):
    """`raydl.train` names both the subpackage of the training loop (raydl/train/) and the function
    raydl.api.train; Python binds the subpackage to that attribute on its first import, so the
    package itself is made callable instead of being shadowed (and `raydl.train.loop` still works)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from raydl.api import train

        return train(*args, **kwargs)


# The subpackage raydl.train: its __init__ is empty, so nothing heavy is imported here.
from raydl import train as _train_package

_train_package.__class__ = _CallablePackage
