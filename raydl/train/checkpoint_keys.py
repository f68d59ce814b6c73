"""Which tensors a checkpoint holds and under which names: a LoRA run's adapters alone, a tied pair once."""

from __future__ import annotations

from typing import Any

from torch import nn

from raydl.models.lora import is_adapter


def adapted(model: nn.Module) -> bool:
    """Whether `model` (this rank's part) trains adapters on frozen weights (train.lora, the only thing raydl
    freezes): a pipeline stage may hold frozen weights and no adapter (a head that none targets)."""
    return any(not p.requires_grad for p in model.parameters())


def trained_part(msd: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of the model: a LoRA run's adapters alone (its base weights are frozen, and recorded
    by location and digest in the fingerprint: raydl.driver.lora_base), else every tensor. Each rank's part of
    each adapter, whatever the layout: DCP reshards them as it does whole models."""
    return {key: value for key, value in msd.items() if is_adapter(key)} if adapted(model) else msd


def tied_pairs(model: nn.Module) -> dict[str, str]:
    """The model's tied parameters ({copy: source}, BlockModel.tied), inside DDP's wrapper too."""
    return getattr(getattr(model, "module", model), "tied", {})


def _stored_name(key: str, tied: dict[str, str]) -> str:
    for copy, source in tied.items():
        if copy in key:   # the parameter's own entry, or its optimizer states' ("state.<name>.exp_avg")
            return key.replace(copy, source)
    return key


def stored(state: dict[str, Any], tied: dict[str, str]) -> dict[str, Any]:
    """`state` as a checkpoint holds it: a tied pair once, under its source's name (the embedding's), whichever
    of the two this rank holds (one module: both names, one tensor; a pipeline's last stage: the copy alone)."""
    out = {}
    for key, value in state.items():
        name = _stored_name(key, tied)
        if name == key or name not in state:
            out[name] = value
    return out


def unstored(state: dict[str, Any], read: dict[str, Any], tied: dict[str, str]) -> dict[str, Any]:
    """`state`'s keys with the values `dcp.load` put into `read` (`stored(state)`)."""
    return {key: read[_stored_name(key, tied)] for key in state}
