"""The four families' transformers classes and the fields their configs take, checked for model.options.

Apart from raydl.models.hf.config so that HfOptions can check its config fields (importing transformers only
when it has some) without the two modules importing each other.
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any

from raydl.errors import ConfigError
from raydl.overrides import coerce

os.environ["HF_HUB_OFFLINE"] = "1"   # before huggingface_hub reads it on import

# family: (config class, causal LM class) in transformers
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}
INSTALL = 'pip install "raydl[hf]"'
# Config fields raydl sets itself, which an option of the same name would be overwritten by: field -> by what.
SET_BY_RAYDL = {"attention_dropout": "model.dropout", "resid_pdrop": "model.dropout", "embd_pdrop": "model.dropout",
                "attn_pdrop": "model.dropout", "bos_token_id": "the dataset's eos token",
                "eos_token_id": "the dataset's eos token"}
# Names of older config.json files that transformers v5 still reads into rope_parameters.
LEGACY_ROPE = ("rope_theta", "rope_scaling")


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.name", "is 'hf', which needs the optional transformers package",
                          f"install it with `{INSTALL}`") from None
    return transformers


def _init_params(family: str) -> dict[str, inspect.Parameter]:
    config_class = getattr(transformers_module(), CLASSES[family][0])
    params = inspect.signature(config_class.__init__).parameters
    return {n: p for n, p in params.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def config_field_names(family: str) -> set[str]:
    """Every name the family's config class takes: its constructor's parameters and its attribute_map."""
    names = set(_init_params(family)) | set(getattr(transformers_module(), CLASSES[family][0]).attribute_map)
    return names | set(LEGACY_ROPE) if "rope_parameters" in names else names


def checked_config_fields(family: str, given: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """model.options entries that are transformers config fields, checked against the family's class (which
    itself keeps any unknown keyword as an attribute, silently), typed like the field's default. `aliases`:
    raydl's other names, offered too when a name is unknown."""
    config_class, names, params = CLASSES[family][0], config_field_names(family), _init_params(family)
    checked = {}
    for name, value in given.items():
        if name in SET_BY_RAYDL:
            by = SET_BY_RAYDL[name]
            raise ConfigError(f"model.options.{name}", f"is set by raydl from {by}",
                              f"drop model.options.{name}" + (" and set model.dropout" if by == "model.dropout" else ""))
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names | set(aliases)), n=1)
            raise ConfigError(f"model.options.{name}", f"is neither an option of model 'hf' nor a field of "
                              f"transformers' {config_class} (model.options.family={family})",
                              (f"did you mean {close[0]}? " if close else "") + f"use a field of {config_class} "
                              "as written in a config.json, or an option `raydl train --help` lists")
        default = params[name].default if name in params else None
        typed = type(default) in (bool, int, float)   # --set gives text, and YAML reads 1e-5 as a string
        checked[name] = coerce(f"model.options.{name}", value, type(default)) if typed else value
    return checked
