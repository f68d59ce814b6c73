"""train.lora, checked: the settings raydl.models.lora.apply_lora applies (one ConfigError per bad key)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raydl.errors import ConfigError

LORA_KEYS = ("rank", "alpha", "dropout", "targets")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSettings:
    """train.lora, checked: what raydl.models.lora.apply_lora applies."""
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | str   # module names or suffixes, or ALL_LINEAR


def lora_settings(values: dict[str, Any]) -> LoraSettings | None:
    """train.lora as LoraSettings (None when off), or the ConfigError naming the key at fault."""
    if not values:
        return None
    for key in values:
        if key not in LORA_KEYS:
            raise ConfigError(f"train.lora.{key}", "is not a LoRA setting",
                              f"use {', '.join(f'train.lora.{k}' for k in LORA_KEYS)}")
    rank = values.get("rank")
    if type(rank) is not int or rank < 1:
        raise ConfigError("train.lora.rank", f"is {rank!r}" if "rank" in values else "is missing (LoRA is on: "
                          f"train.lora holds {sorted(values)})", "set --set train.lora.rank=8 (an integer >= 1), or "
                          "leave train.lora empty for full fine-tuning")
    alpha, dropout = values.get("alpha", 2 * rank), values.get("dropout", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError("train.lora.alpha", f"is {alpha!r}", "set --set train.lora.alpha=16 (a number > 0; "
                          "the adapters' output is scaled by alpha / rank)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError("train.lora.dropout", f"is {dropout!r}", "set --set train.lora.dropout=0.05 (0 <= p < 1)")
    targets = values.get("targets", ALL_LINEAR)
    if isinstance(targets, str) and targets != ALL_LINEAR:
        targets = [targets]
    if targets != ALL_LINEAR and (not isinstance(targets, list) or not targets
                                  or not all(isinstance(t, str) and t for t in targets)):
        raise ConfigError("train.lora.targets", f"is {targets!r}", f"give module names, e.g. --set "
                          f"train.lora.targets=[q_proj,v_proj], or {ALL_LINEAR}")
    return LoraSettings(rank, float(alpha), float(dropout), targets if targets == ALL_LINEAR else tuple(targets))
