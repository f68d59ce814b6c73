"""`model.options` of `model.name: hf`, with the help text `raydl train --help` prints (torch-free).

    --set model.name=hf --set model.options.family=llama --set model.options.layers=4
    --set model.name=hf --set model.options.config=path/to/dir_with_config.json
    --set model.name=hf --set model.options.weights=path/to/save_pretrained_dir
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from raydl.config import _f
from raydl.errors import ConfigError

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
ATTENTION = ("sdpa", "eager")
# The options that describe the architecture: they come from config.json when one is given.
DIMENSIONS = ("family", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "vocab_size",
              "max_positions", "sliding_window")


@dataclass(kw_only=True)
class HfOptions:
    """A Hugging Face causal LM (`pip install "raydl[hf]"`), built from local files only."""

    family: str = _f("llama", "Architecture to build when config and weights are empty: llama, qwen2, mistral or "
                     "gpt2.", choices=FAMILIES)
    config: str = _f("", "Local directory holding a config.json (e.g. save_pretrained output) whose architecture "
                     "and dimensions to build, randomly initialised. Never a Hub name: raydl downloads nothing.")
    weights: str = _f("", "Local save_pretrained directory (config.json + .safetensors) to start from; empty = "
                      "random init.")
    hidden_size: int = _f(64, "Width of the residual stream, a multiple of heads (family only).")
    layers: int = _f(2, "Decoder layers (family only).")
    heads: int = _f(4, "Attention heads (family only).")
    kv_heads: int = _f(0, "Key/value heads for grouped-query attention, dividing heads; 0 = heads (family only; "
                       "not gpt2).")
    intermediate_size: int = _f(0, "MLP width; 0 = 4 x hidden_size (family only).")
    vocab_size: int = _f(0, "Vocabulary; 0 = the dataset's, which it must equal (family only).")
    max_positions: int = _f(0, "Longest sequence (max_position_embeddings); 0 = the dataset's seq_len (family only).")
    sliding_window: int = _f(0, "mistral: attention window in tokens; 0 = full causal attention (family only).")
    attention: str = _f("sdpa", "Attention kernel: sdpa (torch scaled_dot_product_attention) or eager.",
                        choices=ATTENTION)
    dropout: float = _f(0.0, "Dropout probability (set by model.dropout); replaces a config.json's own rates.")

    def __post_init__(self) -> None:
        for name, allowed in (("family", FAMILIES), ("attention", ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.options.{name}", f"is {getattr(self, name)!r}, not one of "
                                  f"{', '.join(allowed)}", f"use e.g. model.options.{name}={allowed[0]}")
        for name in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "vocab_size",
                     "max_positions", "sliding_window"):
            minimum = 1 if name in ("hidden_size", "layers", "heads") else 0
            if getattr(self, name) < minimum:
                raise ConfigError(f"model.options.{name}", f"is {getattr(self, name)}", f"use an integer >= {minimum}")
        self._check_heads()

    def _check_heads(self) -> None:
        if self.hidden_size % self.heads:
            raise ConfigError("model.options.hidden_size", f"({self.hidden_size}) is not a multiple of "
                              f"model.options.heads ({self.heads})", "make hidden_size a multiple of heads")
        if self.kv_heads and (self.family == "gpt2" or self.heads % self.kv_heads):
            problem = "is set for gpt2, which has no grouped-query attention" if self.family == "gpt2" else \
                f"({self.kv_heads}) does not divide model.options.heads ({self.heads})"
            raise ConfigError("model.options.kv_heads", problem, "use 0 (= heads) or a divisor of heads")
        if self.sliding_window and self.family != "mistral":
            raise ConfigError("model.options.sliding_window", f"is set for {self.family}; only mistral has one here",
                              "use model.options.family=mistral, or sliding_window=0")

    def changed_dimensions(self) -> list[str]:
        """The architecture options set away from their defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return [name for name in DIMENSIONS if getattr(self, name) != defaults[name]]
