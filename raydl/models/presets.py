"""The built-in models' size presets and options (`model.options`), kept free of torch so that
`raydl train --help` can list them without importing it.

    raydl train --set model.size=mini --set model.options.layers=3 --set model.options.width=192
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raydl.errors import ConfigError
from raydl.models.hf.options import HfOptions

# name: (layers, width, heads)
GPT_SIZES = {
    "tiny": (4, 128, 4),     # ~0.8M params + embeddings
    "mini": (6, 256, 8),
    "small": (8, 512, 8),
    "gpt2": (12, 768, 12),   # GPT-2 124M: head tied, vocabulary padded (below)
}
# Presets whose head is tied to the token embedding and whose vocabulary (the dataset's, when model.options.vocab
# is 0) is padded to a multiple of 64, as GPT-2 in nanoGPT (50257 -> 50304 rows: faster matmuls on a GPU).
TIED_PRESETS = ("gpt2",)
VOCAB_MULTIPLE = 64

# name: (widths per stage, residual blocks per stage)
RESNET_SIZES = {
    "tiny": ((16, 32, 64), 1),
    "resnet18": ((64, 128, 256, 512), 2),
}


def _option(default: Any, help: str) -> Any:
    if isinstance(default, list):
        return field(default_factory=list, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _check_size(size: str, sizes: dict, model: str) -> None:
    if size not in sizes:
        raise ConfigError("model.size", f"is {size!r}, which model '{model}' does not have",
                          f"use one of {', '.join(sizes)}")


def _check_not_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ConfigError(f"model.options.{name}", f"is {value}", "use 0 (the preset's) or a positive number")


@dataclass(kw_only=True)
class GptOptions:
    size: str = _option("tiny", f"Preset (set by model.size): {', '.join(GPT_SIZES)}; the fields below override "
                        "its dimensions.")
    layers: int = _option(0, "Transformer blocks; 0 = the preset's.")
    width: int = _option(0, "Embedding width, a multiple of heads; 0 = the preset's.")
    heads: int = _option(0, "Attention heads; 0 = the preset's.")
    seq_len: int = _option(0, "Context length (rows of the position embedding), at least the dataset's sequence "
                           "length; 0 = the dataset's.")
    vocab: int = _option(0, "Vocabulary size (token embedding and head rows), at least the dataset's; 0 = the "
                         "dataset's.")
    dropout: float = _option(0.0, "Dropout probability (set by model.dropout).")
    tie_head: str = _option("auto", f"Head tied to the token embedding (one weight, GPT-2's), with the vocabulary "
                            f"padded to a multiple of {VOCAB_MULTIPLE} when vocab is 0: auto = the preset's (yes for "
                            f"{', '.join(TIED_PRESETS)}, no for the others), true, false.")

    def __post_init__(self) -> None:
        _check_size(self.size, GPT_SIZES, "gpt")
        _check_not_negative(layers=self.layers, width=self.width, heads=self.heads, seq_len=self.seq_len,
                            vocab=self.vocab)
        if self.tie_head not in ("auto", "true", "false"):
            raise ConfigError("model.options.tie_head", f"is {self.tie_head!r}", "use auto, true or false")
        _, width, heads = self.dims()
        if width % heads:
            raise ConfigError("model.options.width", f"({width}) is not a multiple of the heads ({heads})",
                              "give a width divisible by model.options.heads")

    @property
    def tied(self) -> bool:
        return self.size in TIED_PRESETS if self.tie_head == "auto" else self.tie_head == "true"

    def vocab_rows(self, dataset_vocab: int) -> int:
        """The embedding's rows: model.options.vocab, else the dataset's (padded when tied)."""
        if self.vocab or not self.tied:
            return self.vocab or dataset_vocab
        return -(-dataset_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def dims(self) -> tuple[int, int, int]:
        """(layers, width, heads): the preset's, with the overrides applied."""
        layers, width, heads = GPT_SIZES[self.size]
        return self.layers or layers, self.width or width, self.heads or heads


@dataclass(kw_only=True)
class ResnetOptions:
    size: str = _option("tiny", f"Preset (set by model.size): {', '.join(RESNET_SIZES)}; the fields below override "
                        "its dimensions.")
    widths: list[int] = _option([], "Channels of each stage, e.g. [32, 64, 128]; [] = the preset's.")
    blocks: int = _option(0, "Residual blocks per stage; 0 = the preset's.")

    def __post_init__(self) -> None:
        _check_size(self.size, RESNET_SIZES, "resnet")
        _check_not_negative(blocks=self.blocks)
        if any(w <= 0 for w in self.widths):
            raise ConfigError("model.options.widths", f"is {self.widths}", "give positive channel counts")

    def dims(self) -> tuple[tuple[int, ...], int]:
        """(widths per stage, residual blocks per stage): the preset's, with the overrides applied."""
        widths, per_stage = RESNET_SIZES[self.size]
        return tuple(self.widths) or widths, self.blocks or per_stage


# What `raydl train --help` lists under model.options.
BUILTIN_OPTIONS = {"gpt": GptOptions, "resnet": ResnetOptions, "hf": HfOptions}
