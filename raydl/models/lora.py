"""LoRA (train.lora) through peft: low-rank adapters injected into a model's Linear layers, its own weights frozen.

`apply_lora` runs on the model as built (on meta or real), before activation checkpointing, compile, the pipeline
split and data parallelism, so every layout sees the same parameter names and only the adapters are trainable:
DDP and FSDP2 reduce only their gradients, and the optimizer is built over them alone. peft's
`inject_adapter_in_model` keeps the model's own class (no PeftModel wrapper): a wrapped Linear becomes a
`lora.Linear` whose `base_layer` is the very module it replaced, so a model built on meta keeps each base weight's
seed and its source (a Hugging Face file) by module, and the adapters are initialized as peft does (A: Kaiming
uniform, B: zeros, so that training starts from the base model's outputs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from raydl.config_lora import ALL_LINEAR, LoraSettings
from raydl.errors import ConfigError

__all__ = ["apply_lora", "adapter_init", "is_adapter", "base_name", "merge_adapters",
           "peft_config", "target_names"]

ADAPTER = "default"        # peft's adapter name: one adapter per run
ADAPTER_PARTS = ("lora_A", "lora_B")
FIELD = "train.lora.targets"


def is_adapter(name: str) -> bool:
    """Whether the parameter (or module) `name` belongs to an adapter."""
    return any(f".{part}." in f".{name}." for part in ADAPTER_PARTS)


def base_name(name: str) -> str:
    """A base tensor's name in the model without adapters (`q.base_layer.weight` -> `q.weight`): how checkpoints of
    full training, train.init_from and Hugging Face files name it."""
    return name.replace(".base_layer.", ".")


def target_names(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The names of the modules the adapters go into. all-linear: every Linear but those of the last block (the
    output head, which maps to the vocabulary); otherwise every module whose name is a target or ends in .target."""
    blocks = getattr(model, "blocks", None)
    last = f"blocks.{list(blocks)[-1]}." if blocks is not None and len(blocks) > 1 else None
    names = []
    for name, module in model.named_modules():
        if settings.targets == ALL_LINEAR:
            if isinstance(module, nn.Linear) and not (last and name.startswith(last)):
                names.append(name)
        elif any(name == t or name.endswith(f".{t}") for t in settings.targets):
            names.append(name)
    return names


def peft_config(settings: LoraSettings, targets: list[str]):
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, bias="none")


def apply_lora(model: nn.Module, *, settings: LoraSettings) -> list[str]:
    """Inject adapters into `model` in place and freeze everything else; returns the wrapped modules' names. What
    cannot be wrapped is refused naming train.lora.targets."""
    targets = target_names(model, settings)
    if not targets:
        raise ConfigError(FIELD, f"is {_shown(settings.targets)}, which matches no module of model "
                          f"'{type(model).__name__}'", f"name Linear layers of the model (e.g. {_examples(model)}), "
                          f"or use {ALL_LINEAR}")
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise ConfigError("train.lora", "needs the peft library, which is not installed",
                          'pip install "raydl[lora]", or leave train.lora empty') from None
    tied = {name.rsplit(".", 1)[0] for pair in getattr(model, "tied", {}).items() for name in pair}
    if tied & set(targets):
        raise ConfigError(FIELD, f"includes {sorted(tied & set(targets))[0]}, whose weight is tied to another "
                          "module's (an adapter on one of the pair would untie them)", "leave it out of the targets")
    try:
        inject_adapter_in_model(peft_config(settings, targets), model, adapter_name=ADAPTER)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(FIELD, f"is {_shown(settings.targets)}, which peft cannot wrap in model "
                          f"'{type(model).__name__}' ({' '.join(str(e).split())[:300]})",
                          f"name only Linear, Embedding or Conv layers (e.g. {_examples(model)}), or use "
                          f"{ALL_LINEAR}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return targets


def _shown(targets) -> str:
    return targets if isinstance(targets, str) else f"[{', '.join(targets)}]"


def _examples(model: nn.Module) -> str:
    # a leaf's own name, or with its parent's where it is a position in a Sequential (mlp.0)
    leaves = sorted({".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]
                     for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    return ", ".join(leaves[:4]) or "none: this model has no Linear layer"


def adapter_init(init: Any, model: nn.Module) -> Any:
    """A MetaInit (raydl.parallel.materialize) that also materializes the adapters `apply_lora` put into `model` on
    meta: each under a seed of its own name, A as nn.Linear's reset (peft's Kaiming uniform), B as zeros; the
    model's own init_weights never touches them."""
    names = dict(init.names)
    adapters = {}
    for name, module in model.named_modules():
        if is_adapter(name) and isinstance(module, nn.Linear):
            names[module] = name
            adapters[module] = name.split(".")[-2]   # lora_A / lora_B
    return dataclasses.replace(init, names=names, init_weights=_skipping(adapters, init.init_weights))


def _skipping(adapters: dict[nn.Module, str], init_weights: Callable | None) -> Callable[[nn.Module], None]:
    def init_module(module: nn.Module) -> None:
        if module in adapters:
            if adapters[module] == "lora_B":
                nn.init.zeros_(module.weight)
        elif init_weights is not None:
            init_weights(module)
    return init_module


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (peft's merge) and put the base module back in its place: the
    model without adapters, its outputs the adapted model's."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
