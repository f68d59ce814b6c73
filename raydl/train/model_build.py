"""The model a worker starts from: built on `meta` when it can be, else whole as before (one warning line).

On meta, nothing is allocated until the engine has applied the layout and calls the returned `MetaInit`
on what this rank keeps (raydl.parallel.materialize). The fallback builds the whole model with real
values under train.seed on every rank, and the engine moves it to the device.

A built model may carry what its materialization needs beyond the spec (raydl.models.hf.model.HfBlocks):
`init_module(module)` (the spec's init_weights, when it has none), `init_like` ({module: module whose seed
it shares}: a head that starts as a copy of the embeddings) and `weights` (a TensorSource to read from).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raydl.config import JobConfig
from raydl.errors import RaydlError
from raydl.models.blocks import BlockModel
from raydl.models.build import SkipWeightInit
from raydl.models.choice import ModelChoice
from raydl.parallel.materialize import MetaInit, init_problem, module_names

__all__ = ["build_for_worker"]

log = logging.getLogger(__name__)


def build_for_worker(chosen: ModelChoice, meta: dict[str, Any], cfg: JobConfig) -> tuple[BlockModel, MetaInit | None]:
    """(the model, how to materialize it); None: the model is real already (the fallback, or debug.whole_model_build:
    `raydl bench memory`'s "before")."""
    model, why = (None, "debug.whole_model_build is set") if cfg.debug.whole_model_build else _try_meta(chosen, meta, cfg)
    if model is not None:
        return model, MetaInit(cfg.train.seed, _seed_names(model), _init_weights(chosen, model),
                               getattr(model, "weights", None), by_rows=chosen.spec.init_by_rows)
    if not dist.is_initialized() or dist.get_rank() == 0:   # one line per run, not one per worker
        log.warning(f"model '{chosen.spec.name}' is built whole on every worker, not on meta: {why}")
    torch.manual_seed(cfg.train.seed)        # identical initial weights on every rank
    return chosen.build(meta, pp_degree=cfg.parallel.pp_degree), None


def _init_weights(chosen: ModelChoice, model: nn.Module):
    return chosen.spec.init_weights or getattr(model, "init_module", None)


def _seed_names(model: nn.Module) -> dict[nn.Module, str]:
    names = module_names(model)
    names.update({module: names[like] for module, like in getattr(model, "init_like", {}).items()})
    return names


def _try_meta(chosen: ModelChoice, meta: dict[str, Any], cfg: JobConfig) -> tuple[BlockModel | None, str]:
    try:
        with torch.device("meta"), SkipWeightInit():
            model = chosen.build(meta, pp_degree=cfg.parallel.pp_degree)
    except RaydlError:
        raise
    except Exception as e:   # the user's build needs real tensors (it reads or copies values)
        return None, f"its build raised {type(e).__name__} on the meta device: {' '.join(str(e).split())[:200]}"
    why = init_problem(model, _init_weights(chosen, model)) or _not_on_meta(model)
    return (None, why) if why else (model, "")


def _not_on_meta(model: nn.Module) -> str:
    real = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta), None)
    return f"its build put {real} on a real device (it ignores the default device)" if real else ""
