"""`HfOptions` + the dataset's meta -> a transformers config, checked; loading local weights.

Nothing reaches the Hugging Face Hub: a path that is not a local directory is refused with a
ConfigError (HF_HUB_OFFLINE is set before transformers loads, and every call is local-only).
Only the four families whose forward `raydl.models.hf.blocks` reproduces are built, from their
own classes, so a config.json's `auto_map` (remote code) is never followed; weights load only
from safetensors (a pickled .bin could run code).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raydl.errors import ConfigError
from raydl.models.hf.classes import CLASSES, transformers_module
from raydl.models.hf.options import FAMILIES, HfOptions

def hf_config(options: HfOptions, meta: dict[str, Any]):
    """The transformers config to build, agreeing with the dataset (vocabulary, sequence length)."""
    source_field = "weights" if options.weights else "config" if options.config else None
    if source_field:
        _refuse_dimensions_beside(source_field, options)
        config = read_config_dir(f"model.options.{source_field}", getattr(options, source_field))
    else:
        config = _family_config(options, meta)
    _check_dataset_agrees(config, meta, source_field)
    _set_dropout(config, options.dropout)
    if "eos" in meta:   # the dataset's document separator, so generation stops where training saw documents end
        config.bos_token_id = config.eos_token_id = meta["eos"]
    return config


def _refuse_dimensions_beside(source_field: str, options: HfOptions) -> None:
    if options.config and options.weights:
        raise ConfigError("model.options.config", "is set together with model.options.weights, which carries its "
                          "own config.json", "set only model.options.weights")
    changed = options.changed_dimensions()
    if changed:
        raise ConfigError(f"model.options.{changed[0]}", f"is set, but the architecture comes from the config.json "
                          f"of model.options.{source_field}", f"drop model.options.{changed[0]}, or drop "
                          f"model.options.{source_field} to build model.options.family from the dimension options")


def read_config_dir(path: str, directory: str):
    """The config.json of a local directory, as its family's config class (no remote code)."""
    folder = Path(directory).expanduser()
    if not (folder / "config.json").is_file():
        hub_like = not folder.exists() and not folder.is_absolute() and directory.count("/") == 1
        why = " (it looks like a Hugging Face Hub name; raydl never downloads)" if hub_like else ""
        raise ConfigError(path, f"is {directory!r}, which is not a local directory holding config.json{why}",
                          "download the model yourself (e.g. `hf download NAME --local-dir DIR`) and pass DIR")
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(path, f"points at '{folder / 'config.json'}', which is not readable JSON ({e})",
                          "pass a directory written by save_pretrained") from None
    family = data.get("model_type") if isinstance(data, dict) else None
    if family not in FAMILIES:
        raise ConfigError(path, f"holds a config.json of model_type {family!r}, which raydl cannot split into "
                          f"pipeline blocks", f"use a {', '.join(FAMILIES)} model")
    data.pop("auto_map", None)   # remote code: never followed
    return getattr(transformers_module(), CLASSES[family][0]).from_dict(data)


def _family_config(options: HfOptions, meta: dict[str, Any]):
    width = options.intermediate_size or 4 * options.hidden_size
    vocab = options.vocab_size or meta["vocab_size"]
    positions = options.max_position_embeddings or meta["seq_len"]
    eos = meta.get("eos")   # the families' own ids (GPT-2's 50256) lie outside a small dataset's vocabulary
    config_class = getattr(transformers_module(), CLASSES[options.family][0])
    layers, heads = options.num_hidden_layers, options.num_attention_heads
    if options.family == "gpt2":
        return config_class(n_embd=options.hidden_size, n_layer=layers, n_head=heads, n_inner=width, vocab_size=vocab,
                            n_positions=positions, bos_token_id=eos, eos_token_id=eos, **options.config_fields)
    extra = {"sliding_window": options.sliding_window or None} if options.family == "mistral" else {}
    return config_class(hidden_size=options.hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=options.num_key_value_heads or heads, intermediate_size=width,
                        vocab_size=vocab, max_position_embeddings=positions, bos_token_id=eos, eos_token_id=eos,
                        **extra, **options.config_fields)


def _set_dropout(config, p: float) -> None:
    """model.dropout everywhere the family drops out (a config.json's own rates included: one knob)."""
    names = ("resid_pdrop", "embd_pdrop", "attn_pdrop") if config.model_type == "gpt2" else ("attention_dropout",)
    for name in names:
        setattr(config, name, p)


def _check_dataset_agrees(config, meta: dict[str, Any], source_field: str | None) -> None:
    where = f"model.options.{source_field}" if source_field else "model.options.vocab_size"
    # A Hugging Face checkpoint's embeddings often have more rows than its tokenizer has tokens (Qwen2: 151,936
    # for 151,665); rows no token id reaches are harmless. Any other difference means other token ids.
    padded = meta.get("tokenizer") == "hf" and config.vocab_size > meta["vocab_size"]
    if config.vocab_size != meta["vocab_size"] and not padded:
        raise ConfigError(where, f"gives a vocabulary of {config.vocab_size} tokens but the dataset's tokenizer has "
                          f"{meta['vocab_size']}", "prepare the dataset with the model's tokenizer (raydl data "
                          "prepare --tokenizer its tokenizer.json), or use a model of the dataset's vocabulary"
                          + ("" if source_field else " (vocab_size=0 takes it)"))
    if config.max_position_embeddings < meta["seq_len"]:
        where = f"model.options.{source_field}" if source_field else "model.options.max_position_embeddings"
        raise ConfigError(where, f"allows {config.max_position_embeddings} positions but the dataset's rows are "
                          f"{meta['seq_len']} tokens", "prepare the dataset with a shorter --seq-len, or allow more "
                          "positions")

