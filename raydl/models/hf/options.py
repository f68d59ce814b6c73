"""`model.options` of `model.name: hf`, with the help text `raydl train --help` prints (torch-free).

    --set model.name=hf --set model.options.family=llama --set model.options.num_hidden_layers=4
    --set model.name=hf --set model.options.layers=4 --set model.options.rope_theta=500000
    --set model.name=hf --set model.options.config=path/to/dir_with_config.json
    --set model.name=hf --set model.options.weights=path/to/save_pretrained_dir
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from raydl.config import _f
from raydl.errors import ConfigError

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
ATTENTION = ("sdpa", "eager")
# The options that describe the architecture: they come from config.json when one is given.
DIMENSIONS = ("family", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "max_position_embeddings", "sliding_window")
# raydl's short names, kept from before the options took transformers' names, and attn_implementation for attention.
ALIASES = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
           "max_positions": "max_position_embeddings", "attn_implementation": "attention"}
# GPT2Config's own names of the dimensions (its attribute_map, and n_inner, which that map lacks).
GPT2_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "n_positions": "max_position_embeddings", "n_inner": "intermediate_size"}


@dataclass(kw_only=True)
class HfOptions:
    """A Hugging Face causal LM (`pip install "raydl[hf]"`), built from local files only."""

    family: str = _f("llama", "Architecture to build when config and weights are empty: llama, qwen2, mistral or "
                     "gpt2.", choices=FAMILIES)
    config: str = _f("", "Local directory holding a config.json (e.g. save_pretrained output) whose architecture "
                     "and dimensions to build, randomly initialised. Never a Hub name: raydl downloads nothing.")
    weights: str = _f("", "Local save_pretrained directory (config.json + .safetensors) to start from; empty = "
                      "random init.")
    hidden_size: int = _f(64, "Width of the residual stream, a multiple of num_attention_heads (family only).")
    num_hidden_layers: int = _f(2, "Decoder layers; alias layers (family only).")
    num_attention_heads: int = _f(4, "Attention heads; alias heads (family only).")
    num_key_value_heads: int = _f(0, "Key/value heads for grouped-query attention, dividing num_attention_heads; "
                                  "0 = num_attention_heads; alias kv_heads (family only; not gpt2).")
    intermediate_size: int = _f(0, "MLP width; 0 = 4 x hidden_size (family only).")
    vocab_size: int = _f(0, "Vocabulary; 0 = the dataset's, which it must equal (family only).")
    max_position_embeddings: int = _f(0, "Longest sequence; 0 = the dataset's seq_len; alias max_positions (family "
                                      "only).")
    sliding_window: int = _f(0, "mistral: attention window in tokens; 0 = full causal attention (family only).")
    attention: str = _f("sdpa", "Attention kernel: sdpa (torch scaled_dot_product_attention) or eager.",
                        choices=ATTENTION)
    dropout: float = _f(0.0, "Dropout probability (set by model.dropout); replaces a config.json's own rates.")
    config_fields: dict[str, Any] = _f({}, "Any other field of the family's transformers config class, given by its "
                                       "own name as in a config.json (model.options.rope_theta=500000, rms_norm_eps, "
                                       "tie_word_embeddings) and checked against that class (family only). Collected "
                                       "here by raydl: not set by this name.")

    @classmethod
    def resolve_names(cls, given: dict[str, Any]) -> dict[str, Any]:
        """model.options as written -> this class's fields: a short name or a GPT-2 name becomes the field it names,
        a name that is none of them goes into config_fields (checked in __post_init__); two names of one field is
        an error."""
        if "config_fields" in given:
            raise ConfigError("model.options.config_fields", "is filled by raydl from the transformers config fields "
                              "given by their own names", "write model.options.<field>=VALUE, e.g. "
                              "model.options.rope_theta=500000")
        names = {**ALIASES, **(GPT2_NAMES if given.get("family") == "gpt2" else {})}
        own = {f.name for f in fields(cls)}
        resolved: dict[str, Any] = {"config_fields": {}}
        written: dict[str, str] = {}   # field -> the name it was given by
        for key, value in given.items():
            name = names.get(key, key)
            if name in written:
                raise ConfigError(f"model.options.{key}", f"and model.options.{written[name]} are both given, and "
                                  f"both set {name}", "keep one of them")
            written[name] = key
            if name in own:
                resolved[name] = value
            else:
                resolved["config_fields"][name] = value
        return resolved

    def __post_init__(self) -> None:
        for name, allowed in (("family", FAMILIES), ("attention", ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.options.{name}", f"is {getattr(self, name)!r}, not one of "
                                  f"{', '.join(allowed)}", f"use e.g. model.options.{name}={allowed[0]}")
        for name in DIMENSIONS[1:]:
            minimum = 1 if name in ("hidden_size", "num_hidden_layers", "num_attention_heads") else 0
            if getattr(self, name) < minimum:
                raise ConfigError(f"model.options.{name}", f"is {getattr(self, name)}", f"use an integer >= {minimum}")
        self._check_heads()
        if self.config_fields and not (self.config or self.weights):   # beside them, hf_config refuses every one
            from raydl.models.hf.classes import checked_config_fields   # imports transformers: only when used

            self.config_fields = checked_config_fields(self.family, self.config_fields, ALIASES)

    def _check_heads(self) -> None:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            raise ConfigError("model.options.hidden_size", f"({self.hidden_size}) is not a multiple of "
                              f"model.options.num_attention_heads ({heads})",
                              "make hidden_size a multiple of num_attention_heads")
        if kv_heads and (self.family == "gpt2" or heads % kv_heads):
            problem = "is set for gpt2, which has no grouped-query attention" if self.family == "gpt2" else \
                f"({kv_heads}) does not divide model.options.num_attention_heads ({heads})"
            raise ConfigError("model.options.num_key_value_heads", problem,
                              "use 0 (= num_attention_heads) or a divisor of it")
        if self.sliding_window and self.family != "mistral":
            raise ConfigError("model.options.sliding_window", f"is set for {self.family}; only mistral has one here",
                              "use model.options.family=mistral, or sliding_window=0")

    def changed_dimensions(self) -> list[str]:
        """The architecture options set away from their defaults, transformers config fields included."""
        defaults = {f.name: f.default for f in fields(self)}
        return [name for name in DIMENSIONS if getattr(self, name) != defaults[name]] + list(self.config_fields)
